"""The verify rule: which drafted tokens a verify pass accepts, and the target's own token.

Sample-and-match: the target's token at each position of the block is its argmax at
temperature 0, else a sample of its processed distribution (:func:`process_logits`:
temperature, top-k, top-p); the longest prefix where the draft equals the target's tokens is
accepted, plus the target's token at the first mismatch (:func:`verify`). So every emitted
token is a token of the target itself and the output distribution is exactly the target's.

The rule never reads how the drafts were chosen, so this holds for any proposal: a DFlash2
drafter's candidate-selector path (greedy, :func:`~dflash_ext.draft.head.draft_tokens`)
included, at T = 0 and T > 0. The serving engines do more at T > 0 for DFlash2: they sample
the path from softmax(scores / T) over each slot's top-K candidates and verify with rejection
sampling against that q (accept with min(1, p/q), else resample from the residual), which
accepts more often than matching a greedy draft; that is not implemented here.
"""
from typing import List, Optional

import torch

__all__ = ["process_logits", "sample_token", "verify"]


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The logits ``[n, V]`` of the distribution a token is sampled from at ``temperature > 0``
    (float32; softmax gives its probabilities): divided by the temperature, the tokens outside
    the top-k (0: off) and outside the smallest prefix reaching probability top-p (1: off) at
    -inf, the most likely token always kept."""
    # Shifted by the row maximum and divided in float64, every finite temperature > 0 is
    # finite math: one so small that logits / T would overflow float32 (inf - inf = NaN in the
    # softmax) gives -inf to every token below the maximum, the greedy limit (ties shared).
    logits = logits.double()
    logits = ((logits - logits.amax(-1, keepdim=True)) / temperature).float()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and the most likely token whatever top_p is (below float32's range it reads as 0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits [n, V]``: argmax at temperature 0, else a sample of the
    :func:`process_logits` distribution."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = process_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def verify(draft: List[int], logits: torch.Tensor, sampling: dict) -> List[int]:
    """The tokens one verify pass emits: the accepted drafts, then the target's own token.
    `draft`: the n drafted tokens; `logits [n + 1, V]`: the target's logits at the block's
    positions (the last accepted token, then the drafts); `sampling`: :func:`sample_token`'s
    keyword arguments. Returns between 1 and n + 1 tokens."""
    target_tokens = sample_token(logits, **sampling).tolist()
    a = 0
    while a < len(draft) and draft[a] == target_tokens[a]:
        a += 1
    return target_tokens[:a + 1]  # the accepted drafts equal the target's tokens
