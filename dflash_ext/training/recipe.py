"""The DFlash training recipe: random anchors inside the response, blocks of
[anchor token, MASK x (B-1)], the block-sparse attention mask, labels and loss weights.

Attention layout of one training sequence (S tokens, nb blocks of B slots): each block's
B queries see the S context rows (the target's projected features of the sequence) and
the block's own B rows. Block a (anchor p_a) sees context rows at positions < p_a and
its own B rows (bidirectional), never another block: exactly what the block at position
p_a sees at inference.
"""
from typing import Optional

import torch

__all__ = ["IGNORE", "default_gamma", "sample_anchors", "block_labels", "loss_weights"]

IGNORE = -100  # label of a slot past the end of the sequence (cross_entropy's ignore_index)


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def sample_anchors(response_start: int, seq_len: int, block_size: int, n: int,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Up to n distinct anchors, sorted, in [response_start, seq_len - 2]: the anchor token
    lies inside the response and has at least one label. Slots past the end of the
    sequence get no label (``block_labels``), so the last tokens (EOS among them) are
    learned at every slot, not only at slot B-1."""
    lo, hi = max(response_start, 1), seq_len - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    count = hi - lo + 1
    pick = torch.randperm(count, generator=generator)[:n]
    return (pick + lo).sort().values


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """labels[a, j - 1] = input_ids[anchor_a + j] for slots j = 1..B-1 (slot 0 is the
    anchor token itself and has no label); IGNORE where anchor_a + j is past the end."""
    offsets = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[:, None] + offsets[None, :]
    inside = pos < input_ids.numel()
    return torch.where(inside, input_ids[pos.clamp(max=input_ids.numel() - 1)], IGNORE)


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j-1)/gamma) for slots j = 1..B-1."""
    j = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)
