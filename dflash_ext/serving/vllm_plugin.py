"""vLLM's general plugin (entry point ``vllm.general_plugins``: ``dflash_ext``): vLLM calls
:func:`register` in each of its processes; it maps the ``DFlashDraftModel`` architecture to
:class:`~.vllm_model.FusedDFlashQwen3ForCausalLM`, vLLM's DFlash drafter with its layers'
norms, RoPE and residual adds on our fused ops. ``DFLASH_VLLM_FUSED=0`` leaves vLLM's own
drafter in place. The model is named by its import path, so nothing of vLLM (nor the model
module) is imported here."""
import os

__all__ = ["register", "ENV_SWITCH", "ARCHITECTURE", "MODEL_PATH"]

ENV_SWITCH = "DFLASH_VLLM_FUSED"
ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry: ("qwen3_dflash", "DFlashQwen3ForCausalLM")
MODEL_PATH = "dflash_ext.serving.vllm_model:FusedDFlashQwen3ForCausalLM"


def enabled() -> bool:
    """Whether the plugin replaces vLLM's drafter: unless DFLASH_VLLM_FUSED is 0 (or false/off/no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def register() -> None:
    """Called by vLLM (vllm.plugins.load_general_plugins), once per process."""
    if not enabled():
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_PATH)
