"""One DFlash step (:func:`speculative_step`): draft -> verify -> accept -> roll back -> inject.

The drafter writes B - 1 tokens in one pass over the block [last token, MASK x (B - 1)]
(``proposer.propose``); the target verifies the block in one pass (:class:`~.runner.TargetRunner`);
the verify rule (:func:`~.verify.verify`: rejection sampling or sample-and-match) accepts a
prefix of the drafts and emits one token of the target's after it; the target's cache is
rolled back to the accepted length (:class:`~.rollback.CacheRollback`) and the accepted
tokens' target hidden states are injected into the drafter's context (``proposer.accept``).
"""
from dataclasses import dataclass
from typing import Callable, List

import torch

from ..sampling import Sampling, split_draft
from .rollback import CacheRollback
from .runner import TargetRunner
from .verify import check_draft, verify

__all__ = ["DecodeState", "speculative_step"]


@dataclass
class DecodeState:
    """Where one sequence stands: the target's cache and how it rolls back (chosen once for
    it, after the prefill), the newest token (not yet seen by the target) and its position."""
    cache: object
    rollback: CacheRollback
    last: int
    pos: int
    draft_checked: bool = False  # the proposer's first draft's values were checked (once per generation)


def _no_clock(phase: str) -> None:
    pass


def speculative_step(runner: TargetRunner, proposer, state: DecodeState, verify_size: int, sampling: Sampling,
                     clock: Callable[[str], None] = _no_clock) -> List[int]:
    """One DFlash step over a block of `verify_size` tokens (1: the target alone, nothing
    drafted): returns the new tokens (the accepted drafts, then the target's own token) and
    advances `state`. `proposer`: ``propose(last_token, position, n)`` and ``accept(hidden
    states, rows, positions)`` (:class:`~dflash_ext.draft.proposer.DFlashProposer`);
    `sampling`: the generation's :class:`~dflash_ext.sampling.Sampling` (its `verify`: the
    rule); ``propose`` returns the draft tokens, or (tokens, q) when it sampled them
    (:class:`~dflash_ext.sampling.Draft`). `clock(phase)` is called as
    each phase ends, for the caller's timing only."""
    drafted = proposer.propose(state.last, state.pos, verify_size - 1) \
        if verify_size > 1 else torch.empty(0, dtype=torch.long)
    draft, draft_probs = split_draft(drafted)
    check_draft(draft, draft_probs, verify_size - 1, runner.vocab_size, values=verify_size > 1 and not state.draft_checked)
    state.draft_checked |= verify_size > 1
    draft = draft.to(runner.device)
    draft_probs = None if draft_probs is None else draft_probs.to(runner.device)
    clock("draft")
    block = torch.cat([torch.tensor([state.last], device=runner.device), draft])[None]
    logits, hidden, state.cache = runner(block, state.cache, rollback=state.rollback)
    clock("verify")
    new = verify(draft, logits[0], sampling, draft_probs)
    accepted = len(new)  # the accepted drafts and the target's token
    state.rollback(block.shape[1] - accepted)
    clock("other")
    if verify_size > 1:  # verify_size 1 is block size 1: the target alone, nothing drafts later
        proposer.accept(hidden, slice(0, accepted), torch.arange(state.pos, state.pos + accepted, device=block.device))
    clock("draft")
    state.last, state.pos = new[-1], state.pos + accepted
    return new
