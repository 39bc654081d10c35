"""A drafter checkpoint that vLLM's DFlash loader reads whole, draft vocabulary included
(``python -m dflash_ext export --for vllm``).

vLLM (``vllm/model_executor/models/qwen3_dflash.py``, ``DFlashQwen3ForCausalLM``) reads the
reference format as it is, but not our draft vocabulary (``dflash_config.draft_vocab_size`` +
``draft_vocab.json``): it reads EAGLE-3's instead. The top-level ``draft_vocab_size`` K sizes
its LM head and its logits; ``lm_head.weight`` [K, H] fills that head (present, the drafter
keeps it; absent, vLLM shares the target's full head, which a K-row table cannot index);
``d2t`` [K] int64 maps draft row i to target token i + d2t[i] (its ``compute_logits`` scatters
the K logits there, -inf elsewhere); ``t2d`` is skipped. So this writes the reference folder
plus those three, and keeps our own fields: :func:`~.checkpoint.read_checkpoint` checks the
two forms agree and loads the folder back as the same drafter (same weights, same draft
vocabulary, same drafts).
"""
import json
from typing import Optional

import torch

from .checkpoint import CONFIG_NAME, VLLM_D2T_NAME, VLLM_LM_HEAD_NAME, WEIGHTS_NAME
from .drafter import DFlashDrafter

__all__ = ["save_for_vllm", "vllm_vocabulary_tensors"]


def vllm_vocabulary_tensors(draft_vocab: torch.Tensor, lm_head_weight: torch.Tensor) -> dict:
    """vLLM's tensors of a draft vocabulary (sorted target token ids): ``d2t`` (int64 offsets,
    row i -> token i + d2t[i]) and ``lm_head.weight`` (the target's LM head rows of those
    tokens, in the head's own dtype so that vLLM's drafts score what the target's head scores)."""
    ids = torch.as_tensor(draft_vocab, dtype=torch.long).cpu()
    if lm_head_weight.dim() != 2 or int(ids.max()) >= lm_head_weight.shape[0]:
        raise ValueError(f"lm_head_weight must be the target's LM head [vocab, hidden] holding every draft token "
                         f"(up to id {int(ids.max())}), got shape {tuple(lm_head_weight.shape)}")
    return {VLLM_D2T_NAME: (ids - torch.arange(ids.numel())).contiguous(),
            VLLM_LM_HEAD_NAME: lm_head_weight.detach()[ids].cpu().contiguous()}


def save_for_vllm(drafter: DFlashDrafter, path: str, lm_head_weight: Optional[torch.Tensor],
                  dtype: Optional[torch.dtype] = None, overwrite: bool = False) -> None:
    """Write `drafter` to `path` as :meth:`DFlashDrafter.save_pretrained` does (`dtype`
    converts its weights), plus vLLM's form of its draft vocabulary (module docstring) made
    from `lm_head_weight`, the target's LM head [vocab, hidden]. A drafter without a draft
    vocabulary is written as the reference format alone (vLLM drafts over the target's head);
    `lm_head_weight` may then be None."""
    if drafter.draft_vocab is None:
        drafter.save_pretrained(path, dtype=dtype, overwrite=overwrite)
        return
    if lm_head_weight is None:
        raise ValueError("lm_head_weight: the drafter has a draft vocabulary, whose rows of the target's LM head "
                         "vLLM reads from the checkpoint; pass the target's LM head weight")
    c = drafter.config
    if tuple(lm_head_weight.shape) != (c.vocab_size, c.hidden_size):
        raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; the drafter's target has an LM "
                         f"head of ({c.vocab_size}, {c.hidden_size})")
    if not bool(torch.isfinite(lm_head_weight).all()):
        raise ValueError("lm_head_weight has non-finite values (NaN/inf)")
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    vocab_tensors = vllm_vocabulary_tensors(drafter.draft_vocab, lm_head_weight)
    config = c.to_json_dict()
    config["draft_vocab_size"] = c.draft_vocab_size  # vLLM reads the top level, we read dflash_config's
    config["torch_dtype"] = str(state["fc.weight"].dtype).replace("torch.", "")

    def write_weights(file: str) -> None:
        from safetensors.torch import save_file

        save_file({**state, **vocab_tensors}, file, metadata={"format": "pt"})

    # save_pretrained checks and writes the reference folder atomically; vLLM's config and
    # weights replace its two files inside that same write (write_checkpoint's extra_files).
    drafter.save_pretrained(path, dtype=dtype, overwrite=overwrite, extra_files={
        CONFIG_NAME: json.dumps(config, indent=2).encode(), WEIGHTS_NAME: write_weights})

