"""DeepSpec's drafters (DSpark, DeepSpec-DFlash: ``DFlashConfig.is_deepspec``) drafting, in
plain PyTorch: :func:`dspark_draft` (one block from given context features, as DeepSpec's
evaluator drafts it) and :class:`DSparkProposer` (``spec_generate``'s proposer: each
sequence's context, a block per step, greedy or sampled under the rejection rule).

The block is anchor-first: [last accepted token, MASK x (block_size - 1)] at positions S..,
every slot drafts (slot k the token at anchor + k + 1), walked left to right through the
Markov head (:func:`~dflash_ext.model.dspark.markov_walk`); at T > 0 each slot's token is a
draw of the processed distribution of its corrected logits (:class:`~dflash_ext.sampling.Sampling`:
temperature, top-k, top-p, as the target's p), which is the q the rejection rule reads.
Not the fused draft runtime: each step runs the drafter's own forward over the whole context.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..model.dspark import block_confidence, dspark_block_hidden, markov_walk
from ..sampling import Draft, Sampling, greedy_token

__all__ = ["DSparkDraft", "dspark_draft", "context_features", "DSparkProposer"]


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


def _chooser(sampling: Optional[Sampling], probs: List[torch.Tensor]):
    """A slot's token from its corrected logits: the argmax (`sampling` None or greedy), else a
    draw of ``sampling.probs(logits)``, appended to `probs` (the q it was drawn from)."""
    if sampling is None or sampling.greedy:
        return greedy_token

    def choose(logits: torch.Tensor) -> torch.Tensor:
        q = sampling.probs(logits)
        probs.append(q)
        return sampling.draw(q)
    return choose


def _check_deepspec(drafter, where: str) -> None:
    c = drafter.config
    if not c.is_deepspec:
        raise ValueError(f"{where} needs a drafter in DeepSpec's format (Qwen3DSparkModel); this one is "
                         f"{'DFlash2' if c.is_dflash2 else 'DFlash'}")


@torch.no_grad()
def dspark_draft(drafter, features: torch.Tensor, anchor_token: int, temperature: float = 0.0,
                 confidence_threshold: float = 0.0, generator: Optional[torch.Generator] = None,
                 top_k: int = 0, top_p: float = 1.0) -> DSparkDraft:
    """One block drafted as DeepSpec drafts it, from the target features of the context
    `features` [S, k*H] and the last accepted token `anchor_token` (at position S): every
    slot's logits ``lm_head(h_k)`` plus the Markov bias after the token drafted before it,
    walked left to right from the anchor (argmax at `temperature` 0; else a draw, with
    `generator`, of q = the processed distribution of the corrected logits: softmax(logits / T)
    with `top_k` / `top_p` as :class:`~dflash_ext.sampling.Sampling` applies them), then kept
    up to the first slot whose confidence is below `confidence_threshold` (0: all of them)."""
    _check_deepspec(drafter, "dspark_draft")
    sampling = Sampling(temperature, top_k, top_p, generator=generator)  # checks the sampling fields
    if not (isinstance(confidence_threshold, (int, float)) and 0 <= confidence_threshold <= 1):
        raise ValueError(f"confidence_threshold must be in [0, 1] (0: no truncation), got {confidence_threshold!r}")
    hidden = dspark_block_hidden(drafter, features, anchor_token)
    probs: List[torch.Tensor] = []
    anchor = torch.tensor(int(anchor_token), device=hidden.device)
    tokens, logits, before = markov_walk(drafter, hidden, anchor, _chooser(sampling, probs))
    confidence, kept = block_confidence(drafter, hidden, before), drafter.config.block_size
    if confidence is not None and confidence_threshold > 0:
        below = (confidence < confidence_threshold).nonzero()
        kept = int(below[0, 0]) if below.numel() else kept
    q = torch.stack(probs)[:kept] if probs else None
    return DSparkDraft(tokens[:kept], q, logits, confidence, hidden)


def context_features(hidden_states, layer_ids: Sequence[int], index: int, rows: slice) -> torch.Tensor:
    """[T, k*H]: the target features of the tokens `rows` of batch row `index` of one target
    pass (a Hugging Face ``hidden_states`` tuple: layer l's output is ``hidden_states[l + 1]``,
    so DeepSpec's -1, the embedding output, is ``hidden_states[0]``), the k layers
    concatenated in `layer_ids` order (the order ``fc`` reads them)."""
    return torch.cat([hidden_states[l + 1][index, rows] for l in layer_ids], -1)


class DSparkProposer:
    """A DeepSpec-format drafter against one target for one generation of `batch_size`
    sequences (the :class:`~dflash_ext.draft.proposer.Proposer` protocol, and the batch's
    ``accept(..., seq, index)`` / :meth:`propose_rows`).

    Each sequence's context is the target features of its accepted tokens (up to `capacity`
    tokens, [S, k*H] in the drafter's dtype); each draft runs the drafter's own embedding,
    backbone and LM head over its block after that whole context (plain PyTorch: the context
    K/V are computed again every step, the cost grows with the context), then the Markov walk.
    `sampling` (the generation's :class:`~dflash_ext.sampling.Sampling`): where it samples
    drafts (T > 0 under the rejection rule) each draft is a :class:`~dflash_ext.sampling.Draft`
    of the tokens and the processed q each was drawn from; otherwise the greedy walk.
    No confidence cut: every requested slot is proposed."""

    def __init__(self, drafter, target, capacity: int, sampling: Optional[Sampling] = None, batch_size: int = 1):
        _check_deepspec(drafter, "DSparkProposer")
        drafter.check_fits(target.config)
        c, p = drafter.config, drafter.fc.weight
        self.drafter, self.capacity, self.block_size = drafter, capacity, c.block_size
        self.layer_ids = list(c.target_layer_ids)  # the TargetRunner asks for hidden_states[l + 1] of these
        self.sampling = sampling if sampling is not None and sampling.samples_drafts else None
        self._empty = p.new_zeros(0, len(self.layer_ids) * c.hidden_size)
        self.contexts = [self._empty] * batch_size

    def reset(self, positions: int) -> None:
        """Start a new generation whose prompt, budget and one block reach `positions` (more
        than `capacity` is a ValueError naming the drafter argument): every context emptied."""
        if positions > self.capacity:
            raise ValueError(f"drafter: this DSparkProposer holds {self.capacity} positions (its capacity), and "
                             f"this generation's prompt, budget and block need {positions}: make one with "
                             f"capacity >= {positions}")
        self.contexts = [self._empty] * len(self.contexts)

    @torch.no_grad()
    def accept(self, hidden_states, rows: slice, positions: torch.Tensor, seq: int = 0, index: int = 0) -> None:
        """Append the target features (:func:`context_features`) of the tokens `rows` of the last
        target pass's batch row `index` to sequence `seq`'s context; `positions`: theirs, in
        order right after the context (the block then starts where the context ends)."""
        feats = context_features(hidden_states, self.layer_ids, index, rows).to(self._empty)
        have = self.contexts[seq].shape[0]
        if have + feats.shape[0] > self.capacity:
            raise RuntimeError(f"DSparkProposer: sequence {seq}'s context would hold {have + feats.shape[0]} tokens, "
                               f"past its capacity of {self.capacity}")
        self.contexts[seq] = torch.cat([self.contexts[seq], feats])

    @torch.no_grad()
    def propose(self, last_token: int, position: int, n: int):
        """n <= block_size draft tokens [n] following `last_token` at `position` (the first n
        slots of its block), or with `sampling` a :class:`~dflash_ext.sampling.Draft` of them
        and their q [n, V]."""
        out = self.propose_rows([0], [last_token], [position], n)
        return out[0] if self.sampling is None else Draft(out.tokens[0], out.probs[0])

    @torch.no_grad()
    def propose_rows(self, seqs: Sequence[int], last_tokens: Sequence[int], positions: Sequence[int], n: int):
        """:meth:`propose` for the sequences `seqs`: [len(seqs), n], or a Draft with q
        [len(seqs), n, V] (each row's backbone pass on its own context, the walk batched)."""
        if not 1 <= n <= self.block_size:
            raise ValueError(f"a DSpark drafter drafts 1..block_size={self.block_size} tokens per block (every slot "
                             f"of [anchor, MASK x {self.block_size - 1}]), asked for {n}: verify blocks of at most "
                             f"{self.block_size + 1} tokens")
        for s, position in zip(seqs, positions):
            if position != self.contexts[s].shape[0]:
                raise RuntimeError(f"DSparkProposer: sequence {s}'s block is at position {position}, but its context "
                                   f"holds {self.contexts[s].shape[0]} tokens (accept the tokens before it first)")
        hidden = torch.stack([dspark_block_hidden(self.drafter, self.contexts[s], t)
                              for s, t in zip(seqs, last_tokens)])
        probs: List[torch.Tensor] = []
        anchor = torch.tensor([int(t) for t in last_tokens], device=hidden.device)
        tokens, _, _ = markov_walk(self.drafter, hidden, anchor, _chooser(self.sampling, probs), n)
        return tokens if self.sampling is None else Draft(tokens, torch.stack(probs, -2))
