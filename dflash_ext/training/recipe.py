"""The DFlash training recipe: random anchors inside the response, blocks of
[anchor token, MASK x (B-1)], the block-sparse attention mask, labels and loss weights.

Attention layout of one training sequence (S tokens, nb blocks of B slots): queries are
the nb*B block slots; keys are the S context rows (the target's projected features of
the sequence) followed by the nb*B block rows. Block a (anchor p_a) sees context rows at
positions < p_a and its own B rows (bidirectional), never another block: exactly what
the block at position p_a sees at inference.
"""
import math
from typing import Optional

import torch

__all__ = ["default_gamma", "sample_anchors", "block_mask", "block_mask_mod", "block_labels", "loss_weights"]


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def sample_anchors(response_start: int, seq_len: int, block_size: int, n: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Up to n distinct anchors, sorted, in [response_start, seq_len - block_size]: the
    anchor token and its B-1 labels all lie inside the response."""
    lo, hi = max(response_start, 1), seq_len - block_size
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    count = hi - lo + 1
    pick = torch.randperm(count, generator=generator)[:n]
    return (pick + lo).sort().values


def block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [nb*B, seq_len + nb*B] (True = attend); memory is what one sequence's
    attention needs, nothing quadratic in the number of sequences."""
    nb = anchors.numel()
    q_block = torch.arange(nb * block_size, device=anchors.device) // block_size
    ctx = torch.arange(seq_len, device=anchors.device)[None, :] < anchors[q_block][:, None]
    own = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx, own], dim=1)


def block_mask_mod(anchors: torch.Tensor, seq_len: int, block_size: int):
    """The same mask as a FlexAttention mask_mod (b, h, q_idx, kv_idx) -> bool."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        is_ctx = kv_idx < seq_len
        kv_block = (kv_idx - seq_len).clamp(min=0) // block_size
        return torch.where(is_ctx, kv_idx < anchors[q_block], kv_block == q_block)

    return mask_mod


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """labels[a, j - 1] = input_ids[anchor_a + j] for slots j = 1..B-1 (slot 0 is the
    anchor token itself and has no label)."""
    offsets = torch.arange(1, block_size, device=anchors.device)
    return input_ids[anchors[:, None] + offsets[None, :]]


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j-1)/gamma) for slots j = 1..B-1."""
    j = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)
