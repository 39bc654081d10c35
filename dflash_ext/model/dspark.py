"""DSpark's heads and its draft of one block, in plain PyTorch (DeepSpec's format:
``deepspec/modeling/dspark/`` of deepseek-ai/DeepSpec; DSpark_paper.pdf there).

The backbone is DFlash's, over ``[anchor token, MASK x (block_size - 1)]``, with this layout:
every slot drafts, slot k the token at anchor + k + 1. Two heads follow it:

- the **Markov head** (:class:`MarkovHead`, ``markov_rank`` r > 0) adds to slot k's LM-head
  logits a bias from the token drafted before it (prev_0 = the anchor), so the block is
  drafted left to right: vanilla ``W2 W1[prev_k]``; gated ``W2 (sigmoid(gate([h_k;
  W1[prev_k]])) * W1[prev_k])``; rnn a GRU-like state s over the block (s_0 = 0):
  ``[g; c; o] = joint([s; W1[prev_k]; h_k])``, ``s' = sigmoid(g) s + (1 - sigmoid(g))
  tanh(c)``, bias ``W2 tanh(o)``;
- the **confidence head** (:class:`ConfidenceHead`) c_k = sigmoid(w . [h_k; W1[prev_k]] + b)
  (or of h_k alone): DeepSpec keeps a block up to its first slot with c_k below a
  threshold (0: the whole block).

The fused draft runtime does not run these drafters yet.
"""
from typing import Optional

import torch
import torch.nn as nn

from .config import DFlashConfig

__all__ = ["MarkovHead", "ConfidenceHead"]


class MarkovHead(nn.Module):
    """DSpark's Markov head of `markov_head_type` (vanilla, gated, rnn), tensors named as
    DeepSpec's: ``markov_w1`` (an embedding V x r), ``markov_w2`` (r -> V, no bias), gated's
    ``gate_proj`` (H + r -> r) and rnn's ``joint_proj`` (2r + H -> 3r), both with a bias."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        V, H, r = c.vocab_size, c.hidden_size, c.markov_rank
        self.kind, self.rank = c.markov_head_type, r
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def initial_state(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The state before slot 0 (rnn: zeros [..., r]; the other kinds keep none)."""
        return hidden.new_zeros(*hidden.shape[:-1], self.rank) if self.kind == "rnn" else None

    def step(self, state: Optional[torch.Tensor], previous: torch.Tensor, hidden: torch.Tensor):
        """(next state, logit bias [..., V]) of one slot from the token drafted before it
        `previous` [...] and the slot's final-normed hidden state `hidden` [..., H]."""
        e = self.markov_w1(previous).to(hidden.dtype)
        if self.kind == "vanilla":
            return state, self.markov_w2(e)
        if self.kind == "gated":
            return state, self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))) * e)
        gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(candidate), self.markov_w2(torch.tanh(out))


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: one logit per slot (``proj``: a linear with bias) over the
    slot's hidden state, followed with the Markov embedding of the token before it when
    `confidence_head_with_markov`."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.with_markov = c.confidence_head_with_markov
        self.proj = nn.Linear(c.hidden_size + (c.markov_rank if self.with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, previous_embedding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """c [...] in fp32, in (0, 1), from `hidden` [..., H] (and `previous_embedding` [..., r])."""
        x = torch.cat([hidden, previous_embedding.to(hidden.dtype)], -1) if self.with_markov else hidden
        return torch.sigmoid(self.proj(x).squeeze(-1).float())
