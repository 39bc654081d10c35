"""DSpark's heads, the backbone pass over one block and its Markov walk, in plain PyTorch
(DeepSpec's format: ``deepspec/modeling/dspark/`` of deepseek-ai/DeepSpec; DSpark_paper.pdf there).

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

:func:`dspark_block_hidden` runs the backbone over one block, :func:`markov_walk` drafts its
slots left to right with a token chooser (the argmax, or a draw: the sampling is
:mod:`dflash_ext.sampling`'s, one layer up, so the draft itself is
:func:`dflash_ext.draft.dspark.dspark_draft`), :func:`block_confidence` scores its slots; the
fused draft runtime does not run these drafters yet.
"""
from typing import Callable, Optional

import torch
import torch.nn as nn

from .config import DFlashConfig

__all__ = ["MarkovHead", "ConfidenceHead", "dspark_block_hidden", "markov_walk", "block_confidence"]


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


def dspark_block_hidden(drafter, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
    """[B, H]: the final-normed hidden states of the block [anchor, MASK...] drafted after the
    S context tokens whose target features are `features` [S, k*H] (the anchor at position S,
    seeing all of them): the drafter's own forward, one block."""
    c = drafter.config
    S, weight = features.shape[0], drafter.fc.weight
    ids = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=weight.device)
    ids[0, 0] = int(anchor_token)
    anchors = torch.tensor([S], device=weight.device)
    return drafter(features.to(weight), drafter.embed_tokens(ids), anchors)[0]


def markov_walk(drafter, hidden: torch.Tensor, anchor: torch.Tensor,
                choose: Callable[[torch.Tensor], torch.Tensor], n: Optional[int] = None) -> tuple:
    """(tokens [..., n], logits [..., n, V], previous [..., n]) of the first n slots (default:
    all) of blocks whose final-normed hidden states are `hidden` [..., B, H], drafted after the
    `anchor` tokens [...]: slot k's logits are ``lm_head(h_k)`` plus the Markov bias after the
    token before it (`previous`: the anchor, then the token taken at k - 1; no bias without a
    Markov head), and its token is ``choose(logits [..., V])`` (a token id [...]: the argmax,
    or a draw). Only the n slots go through the LM head."""
    n = hidden.shape[-2] if n is None else n
    if not 1 <= n <= hidden.shape[-2]:
        raise ValueError(f"a DSpark block of {hidden.shape[-2]} slots drafts 1..{hidden.shape[-2]} tokens, "
                         f"asked for {n}")
    hidden = hidden[..., :n, :]
    base = drafter.lm_head(hidden)
    markov = getattr(drafter, "markov_head", None)
    state = None if markov is None else markov.initial_state(hidden[..., 0, :])
    previous = anchor
    tokens, logits, before = [], [], []
    for k in range(n):
        step = base[..., k, :]
        if markov is not None:
            state, bias = markov.step(state, previous, hidden[..., k, :])
            step = step + bias
        before.append(previous)
        previous = choose(step)
        tokens.append(previous)
        logits.append(step)
    return torch.stack(tokens, -1), torch.stack(logits, -2), torch.stack(before, -1)


def block_confidence(drafter, hidden: torch.Tensor, previous: torch.Tensor) -> Optional[torch.Tensor]:
    """The confidence head's c [..., n] (fp32) of the slots whose hidden states are `hidden`
    [..., n, H] and whose tokens before them are `previous` [..., n] (:func:`markov_walk`'s);
    None without the head."""
    head = getattr(drafter, "confidence_head", None)
    if head is None:
        return None
    return head(hidden, drafter.markov_head.markov_w1(previous) if head.with_markov else None)
