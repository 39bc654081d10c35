"""dflash_ext: DFlash block-diffusion speculative decoding, over fused PyTorch ops.

The public API, exported here once (its layers, one way down: docs/layout.md):

- the ops (``torch.ops.dflash_ext.*``): :func:`project_features`, :func:`inject_context_kv`,
  :func:`block_attention`, :func:`skinny_linear`, :func:`block_conv`, :func:`rms_norm`,
  :func:`qk_norm_rope`; the module :mod:`ops` (the op API; beside it :mod:`.ops.reference`,
  the plain-PyTorch specification of every op, and :mod:`.ops.hardware`: CPU features, ISA
  level, dtype choice); :func:`streamed_linears` (a model's linear layers through skinny_linear);
- the drafter: :class:`DFlashDrafter`, :class:`DFlashConfig`;
- drafting: :class:`DFlashProposer` (spec_generate's), :class:`DFlashAssistant` (an
  ``assistant_model`` for Hugging Face ``generate``);
- decoding: :func:`spec_generate`, :func:`target_generate`, :class:`GenerationResult`,
  :func:`choose_block_size`, :class:`BlockSizeChoice`;
- the embedded default target and its drafter: :func:`load_default_target`,
  :func:`load_target`, :func:`default_drafter_path`;
- :func:`info` (``python -m dflash_ext info``): what was built and what runs here.

Importing the package loads the compiled extension; the rest loads on first use, the 0.1
paths too (until 0.3: :mod:`._deprecated`, whose finder is all that importing installs).
"""
__version__ = "0.1.0"  # the one place: pyproject.toml reads it from this line
import importlib

import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from . import _deprecated, ops  # noqa: E402  (ops loads the compiled extension)
from .ops import (block_attention, block_conv, inject_context_kv, project_features, qk_norm_rope,  # noqa: E402
                  rms_norm, skinny_linear)

# The public names that load on first use (the decoding side imports transformers), by module.
_LAZY = {
    "streamed_linears": "ops.linear",
    "DFlashDrafter": "model.drafter",
    "DFlashConfig": "model.config",
    "load_target": "model.pretrained",
    "load_default_target": "model.pretrained",
    "default_drafter_path": "model.pretrained",
    "DFlashProposer": "draft.proposer",
    "DFlashAssistant": "draft.assistant",
    "spec_generate": "decode.loop",
    "target_generate": "decode.loop",
    "GenerationResult": "decode.output",
    "choose_block_size": "decode.autotune",
    "BlockSizeChoice": "decode.autotune",
    "info": "diagnostics",
}

__all__ = ["ops", "project_features", "inject_context_kv", "block_attention", "skinny_linear",
           "block_conv", "rms_norm", "qk_norm_rope", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = _deprecated.with_old_methods(name, getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name))
        globals()[name] = value
        return value
    return _deprecated.old_attribute(__name__, __all__, name)  # a 0.1 path, else an AttributeError


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


_deprecated.install(__name__, __all__)
