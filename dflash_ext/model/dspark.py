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

:func:`dspark_draft` drafts one block from the context features (greedy, or sampled with
q = softmax(corrected logits / T)); the fused draft runtime does not run these drafters yet.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .config import DFlashConfig

__all__ = ["MarkovHead", "ConfidenceHead", "DSparkDraft", "dspark_block_hidden", "dspark_draft"]


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


@dataclass
class DSparkDraft:
    """One drafted block: `tokens` [n] the drafts kept (n <= block_size: the block up to its
    first slot under the confidence threshold), `q` [n, V] their fp32 draft distributions at
    T > 0 (None at T = 0), and for every slot of the block `logits` [B, V] (Markov-corrected),
    `confidence` [B] (None without the head) and `hidden` [B, H]."""
    tokens: torch.Tensor
    q: Optional[torch.Tensor]
    logits: torch.Tensor
    confidence: Optional[torch.Tensor]
    hidden: torch.Tensor


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


@torch.no_grad()
def dspark_draft(drafter, features: torch.Tensor, anchor_token: int, temperature: float = 0.0,
                 confidence_threshold: float = 0.0, generator: Optional[torch.Generator] = None) -> DSparkDraft:
    """One block drafted as DeepSpec drafts it, from the target features of the context
    `features` [S, k*H] and the last accepted token `anchor_token` (at position S): every
    slot's logits ``lm_head(h_k)`` plus the Markov bias after the token drafted before it,
    walked left to right from the anchor (argmax at `temperature` 0; else a sample of q =
    softmax(logits / T) drawn with `generator`), then kept up to the first slot whose
    confidence is below `confidence_threshold` (0: all of them)."""
    c = drafter.config
    if not c.is_deepspec:
        raise ValueError("dspark_draft needs a drafter in DeepSpec's format (Qwen3DSparkModel); this one is "
                         f"{'DFlash2' if c.is_dflash2 else 'DFlash'}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(confidence_threshold, (int, float)) and 0 <= confidence_threshold <= 1):
        raise ValueError(f"confidence_threshold must be in [0, 1] (0: no truncation), got {confidence_threshold!r}")
    hidden = dspark_block_hidden(drafter, features, anchor_token)
    base = drafter.lm_head(hidden)
    markov = getattr(drafter, "markov_head", None)
    state = None if markov is None else markov.initial_state(hidden[0])
    previous = torch.tensor(int(anchor_token), device=hidden.device)
    tokens, logits, before = [], [], []
    for k in range(c.block_size):
        step = base[k]
        if markov is not None:
            state, bias = markov.step(state, previous, hidden[k])
            step = step + bias
        before.append(previous)
        if temperature == 0:
            previous = step.argmax(-1)
        else:
            previous = torch.multinomial(torch.softmax(step.float() / temperature, -1), 1, generator=generator)[0]
        tokens.append(previous)
        logits.append(step)
    tokens, logits, before = torch.stack(tokens), torch.stack(logits), torch.stack(before)
    confidence, kept = None, c.block_size
    head = getattr(drafter, "confidence_head", None)
    if head is not None:
        confidence = head(hidden, markov.markov_w1(before) if head.with_markov else None)
        if confidence_threshold > 0:
            below = (confidence < confidence_threshold).nonzero()
            kept = int(below[0, 0]) if below.numel() else c.block_size
    q = None if temperature == 0 else torch.softmax(logits[:kept].float() / temperature, -1)
    return DSparkDraft(tokens[:kept], q, logits, confidence, hidden)
