"""dflash_ext: fused PyTorch ops for DFlash block-diffusion speculative decoding.

Importing the package loads the compiled extension, which registers the ops under
``torch.ops.dflash_ext``; :mod:`dflash_ext.ops` is the public API and
:mod:`dflash_ext.reference` the plain-PyTorch specification of every op.
"""
import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from ._cpu_check import require_cpu_features
from .hardware import cap_onednn_isa_from_env

require_cpu_features()
cap_onednn_isa_from_env()

from . import _C  # noqa: E402  (registers torch.ops.dflash_ext.*)
from . import hardware, ops, reference  # noqa: E402

_C._cpu_isa()  # reads DFLASH_CPU_ISA now: a bad value is an error at import, not at a call
from .ops import block_attention, inject_context_kv, project_features, skinny_linear  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ops", "reference", "project_features", "inject_context_kv", "block_attention", "skinny_linear"]
