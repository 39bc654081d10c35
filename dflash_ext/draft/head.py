"""The target's parts a draft step runs: the embedding of the block [token, MASK...]
(:func:`block_embedding`, here and in training), the LM head over the draft vocabulary
(:func:`vocab_head`), its logits at the prediction slots (:func:`slot_logits`) and the greedy draft
tokens from the drafter's hidden states (:func:`greedy_draft`). The draft runtime
(:class:`~.runtime.DraftRuntime`) holds what these make once; nothing is kept here."""
import copy
from typing import Optional

import torch
from torch import nn

from ..model.layers import CandidateSelector
from ..ops.linear import lm_head_linear
from ..sampling import greedy_token

__all__ = ["block_embedding", "vocab_head", "slot_logits", "greedy_draft"]


def block_embedding(target) -> nn.Module:
    """The target's input embedding as DFlash embeds a block [token, MASK...]: as
    transformers' DFlash path does (``DFlashTokenCandidateGenerator._get_noise_embeds``),
    without the normaliser some embeddings apply after the lookup (``embed_norm``), keeping
    any scale (Gemma's sqrt(H)). A view that shares the target's weights and leaves its
    embedding as it is (transformers swaps the norm out per call, which a captured CUDA
    graph or a concurrent target forward would not survive)."""
    embed = target.get_input_embeddings()
    if getattr(embed, "embed_norm", None) is None:
        return embed
    view = copy.copy(embed)
    view._modules = {**embed._modules, "embed_norm": nn.Identity()}
    return view


def vocab_head_key(lm_head: nn.Module, dtype: torch.dtype) -> tuple:
    """What :func:`vocab_head`'s copy depends on: the head's weight and bias (their storage,
    version, device, dtype) and the dtype asked for. Another key: gather again."""
    w, bias = lm_head.weight, getattr(lm_head, "bias", None)
    return (w.data_ptr(), w._version, w.device, w.dtype, dtype,
            None if bias is None else (bias.data_ptr(), bias._version))


def vocab_head(lm_head: nn.Module, vocab: torch.Tensor, dtype: Optional[torch.dtype] = None):
    """(token ids, weight rows, bias rows or None) of the draft vocabulary `vocab` (sorted
    token ids) in the target's `lm_head`, on its device, in `dtype` (default: the head's; the
    drafter's own, where it drafts in another dtype than the target's): a copy of V' rows,
    which the runtime gathers once and again only when :func:`vocab_head_key` changes."""
    w = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    dtype = w.dtype if dtype is None else dtype
    ids = vocab.to(w.device)
    return ids, w.detach()[ids].to(dtype).contiguous(), None if bias is None else bias.detach()[ids].to(dtype)


def slot_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 n: Optional[int] = None) -> torch.Tensor:
    """The LM head's logits [Bsz, n, V'] at slots 1..n of the drafter's final hidden states
    [Bsz, B, H] (default n = B - 1; slot 0 is the last accepted token). Only those n rows go
    through the LM head, the step's largest GEMM (:func:`~dflash_ext.ops.linear.lm_head_linear`
    picks its kernel)."""
    Bsz, B, H = hidden.shape
    n = B - 1 if n is None else n
    return lm_head_linear(hidden[:, 1:n + 1].reshape(Bsz * n, H), weight, bias).view(Bsz, n, -1)


def greedy_draft(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 vocab: Optional[torch.Tensor] = None, n: Optional[int] = None,
                 selector: Optional[CandidateSelector] = None, anchor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Greedy draft tokens [Bsz, n] from the drafter's final hidden states [Bsz, B, H]: the
    argmax of the LM head (`weight`, `bias`; :func:`slot_logits`) at slots 1..n. With a draft
    vocabulary, `weight` holds the rows of those token ids only and `vocab` maps back. A
    DFlash2 drafter's `selector` drafts its path from the `anchor` tokens [Bsz] (the block's
    slot 0) over these logits instead of the argmax. (At T > 0 the draft is sampled:
    :func:`~dflash_ext.sampling.sample_draft`.)"""
    n = hidden.shape[1] - 1 if n is None else n
    logits = slot_logits(hidden, weight, bias, n)
    if selector is not None:
        return selector(hidden[:, 1:n + 1], logits, anchor, vocab)
    best = greedy_token(logits)
    return best if vocab is None else vocab[best]
