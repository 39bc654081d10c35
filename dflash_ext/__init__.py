"""dflash_ext: fused PyTorch ops for DFlash block-diffusion speculative decoding.

Importing the package loads the compiled extension, which registers the ops under
``torch.ops.dflash_ext``; :mod:`dflash_ext.ops` is the public API and
:mod:`dflash_ext.reference` the plain-PyTorch specification of every op.
:func:`info` (``python -m dflash_ext info``) says what was built and what runs here.
"""
__version__ = "0.1.0"  # the one place: pyproject.toml reads it from this line
import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from ._cpu_check import require_cpu_features
from .hardware import cap_onednn_isa_from_env

require_cpu_features()
cap_onednn_isa_from_env()

try:
    from . import _C  # noqa: E402  (registers torch.ops.dflash_ext.*)
except ModuleNotFoundError as e:
    if e.name != f"{__name__}._C":
        raise
    raise ImportError("dflash_ext's compiled extension is not built here: ./run.sh builds it, or "
                      "pip install --no-build-isolation -e . (docs/build.md)") from e
except ImportError as e:  # most often a torch other than the one the extension was built with
    raise ImportError(f"dflash_ext {__version__}: its compiled extension failed to load with torch "
                      f"{torch.__version__} ({e}). It loads only with the torch minor version it was built "
                      "against (pyproject.toml: torch>=2.14,<2.15): install that torch, or rebuild "
                      "(pip install --no-build-isolation .)") from e
from . import hardware, ops, reference  # noqa: E402

_C._cpu_isa()  # reads DFLASH_CPU_ISA now: a bad value is an error at import, not at a call
from .ops import block_attention, block_conv, inject_context_kv, project_features, skinny_linear  # noqa: E402


def info() -> dict:
    """What a bug report needs: versions, the CUDA architectures compiled in and whether they
    run here, the CPU ISA and each op's path, the default target and drafter found
    (:mod:`dflash_ext.diagnostics`; ``python -m dflash_ext info`` prints it)."""
    from .diagnostics import info as _info

    return _info()


__all__ = ["ops", "reference", "project_features", "inject_context_kv", "block_attention", "skinny_linear", "block_conv",
           "info"]
