"""One DFlash step (:func:`speculative_step`): draft -> verify -> accept -> roll back -> inject,
over the rows of a generation: one prompt is one row, a batch (:mod:`.batch`) several.

The drafter writes B - 1 tokens per row in one pass over the blocks [last token, MASK x (B - 1)]
(``proposer.propose_rows``); the target verifies the blocks in one pass
(:class:`~.runner.TargetRunner`); the verify rule (:func:`~.verify.verify_rows`: rejection
sampling or sample-and-match) accepts a prefix of each row's drafts and emits one token of the
target's after it; the target's cache keeps each row's accepted tokens only (:class:`OneRow`:
rolled back, :class:`~.rollback.CacheRollback`; a batch's :class:`~.batch.RaggedCache`: the
rest become holes) and the accepted tokens' target hidden states are injected into the
drafter's context (``proposer.accept``).
"""
from dataclasses import dataclass
from typing import Callable, List, Protocol

import torch

from ..sampling import Sampling, split_draft
from .rollback import CacheRollback
from .runner import TargetRunner
from .verify import check_draft, verify_rows

__all__ = ["TargetRows", "OneRow", "DecodeState", "speculative_step"]


class TargetRows(Protocol):
    """The target's cache of a generation's rows as a step uses it: ``cache`` (what the
    target's forward takes and returns), the arguments of a pass of n tokens per row at
    `positions` [rows, n], and how each row keeps its first ``counts[i]`` of them."""
    cache: object

    def pass_args(self, n: int, positions: torch.Tensor) -> dict: ...

    def keep(self, counts: List[int], n: int) -> None: ...


class OneRow:
    """One sequence's cache (any kind a target has), its rejected tokens rolled back
    (:class:`~.rollback.CacheRollback`, chosen once for it after the prefill)."""

    def __init__(self, cache, rollback: CacheRollback):
        self.cache, self.rollback = cache, rollback

    def pass_args(self, n: int, positions: torch.Tensor) -> dict:
        return {"rollback": self.rollback}  # the cache's own length places the block

    def keep(self, counts: List[int], n: int) -> None:
        self.rollback(n - counts[0])


@dataclass
class DecodeState:
    """Where a generation's rows stand: the target's cache of them (:class:`TargetRows`),
    and per row its sequence in the proposer, its newest token (not yet seen by the target)
    and that token's position."""
    target: TargetRows
    seqs: List[int]
    lasts: List[int]
    positions: List[int]
    draft_checked: bool = False  # the proposer's first drafts' values were checked (once per generation)

    def keep_rows(self, rows: List[int]) -> None:
        """Keep the rows `rows` (indices into the current ones, in order): the others left."""
        self.seqs, self.lasts, self.positions = ([values[i] for i in rows]
                                                 for values in (self.seqs, self.lasts, self.positions))


def _no_clock(phase: str) -> None:
    pass


def speculative_step(runner: TargetRunner, proposer, state: DecodeState, verify_size: int, sampling: Sampling,
                     clock: Callable[[str], None] = _no_clock) -> List[List[int]]:
    """One DFlash step over blocks of `verify_size` tokens (1: the target alone, nothing
    drafted): returns each row's new tokens (its accepted drafts, then the target's own token)
    and advances `state`. `proposer`: ``propose_rows(seqs, last tokens, positions, n)`` (the
    drafts [rows, n], or a :class:`~dflash_ext.sampling.Draft` with their q [rows, n, V]) and
    ``accept(hidden states, rows, positions, seq, index)``
    (:class:`~dflash_ext.draft.proposer.DFlashProposer`, :class:`~.batch.RowProposers`);
    `sampling`: the generation's :class:`~dflash_ext.sampling.Sampling` (its `verify`: the
    rule). `clock(phase)` is called as each phase ends, for the caller's timing only."""
    device, rows, n = runner.device, len(state.seqs), verify_size - 1
    drafted = proposer.propose_rows(state.seqs, state.lasts, state.positions, n) if n \
        else torch.empty(rows, 0, dtype=torch.long)
    drafts, probs = split_draft(drafted)
    check_draft(drafts, probs, n, runner.vocab_size, values=n > 0 and not state.draft_checked)
    state.draft_checked |= n > 0
    drafts, probs = drafts.to(device), None if probs is None else probs.to(device)
    clock("draft")
    block = torch.cat([torch.tensor(state.lasts, device=device)[:, None], drafts], 1)
    positions = torch.tensor(state.positions, device=device)[:, None] + torch.arange(verify_size, device=device)
    logits, hidden, state.target.cache = runner(block, state.target.cache, hidden_states=n > 0,
                                                **state.target.pass_args(verify_size, positions))
    clock("verify")
    news = verify_rows(drafts, logits, sampling, probs)
    state.target.keep([len(new) for new in news], verify_size)
    clock("other")
    if n:  # n = 0 is block size 1: the target alone, nothing drafts later
        for i, (seq, new) in enumerate(zip(state.seqs, news)):
            accepted = positions[i, :len(new)]
            proposer.accept(hidden, slice(0, len(new)), accepted, seq=seq, index=i)
    clock("draft")
    state.lasts = [new[-1] for new in news]
    state.positions = [p + len(new) for p, new in zip(state.positions, news)]
    return news
