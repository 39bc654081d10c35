"""Tree verification (issue 66): one DFlash draft pass, a tree of its best paths, one verify pass
(``spec_generate(..., tree_budget=N)``).

A DFlash drafter's slots are independent per-depth distributions, so one draft pass gives a
whole tree of candidates for free: the N most probable paths of the slots' product
distribution (:func:`~.tree_build.build_tree`). The target verifies the tree in one pass of
N + 1 tokens under an ancestor mask, the rule accepts the longest path the target itself
would have produced (:func:`~.tree_verify.verify_tree`: exact at every temperature), the
cache keeps that path's K/V (:func:`~.tree_verify.keep_path`), and the drafter receives the
path's target hidden states, as after a chain step.

- :class:`TreeProposer`: what :func:`tree_step` asks of a drafter, ``propose_distribution``
  (a :class:`~dflash_ext.sampling.DraftDistribution`: per-slot logits, and the draft
  vocabulary's token ids) and ``accept``
  (:class:`~dflash_ext.draft.proposer.DFlashProposer` is one);
- :func:`tree_step`: one step, the contract of :func:`~.step.speculative_step` for one row
  (its new tokens, the :class:`~.step.DecodeState` advanced).
"""
from typing import Callable, List, Protocol, runtime_checkable

import torch

from ..sampling import DraftDistribution, Sampling
from .runner import TargetRunner
from .step import DecodeState, _no_clock
from .tree_build import build_tree
from .tree_verify import keep_path, tree_inputs, verify_tree

__all__ = ["TreeProposer", "tree_step", "tree_logprobs"]


@runtime_checkable
class TreeProposer(Protocol):
    """What :func:`tree_step` drives: ``propose_distribution(last_token, position, n)`` returns
    a :class:`~dflash_ext.sampling.DraftDistribution` of n slots after `last_token` at `position`; ``accept`` takes
    the target hidden states of the accepted tokens (as :class:`~dflash_ext.draft.proposer.Proposer`'s,
    with `rows` a long tensor of the pass's rows: the root, then the accepted path's nodes)."""

    def accept(self, hidden_states, rows, positions: torch.Tensor) -> None: ...

    def propose_distribution(self, last_token: int, position: int, n: int) -> DraftDistribution: ...


def tree_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The per-slot log-probabilities a tree is built from: the drafter's distribution at the
    generation's temperature (T = 0: at 1, its own calibration). Only the temperature: a
    top-k / top-p cut would tie every token it drops at -inf (the tree ranks candidates, the
    verify rule alone decides what is emitted)."""
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    return (logits.double() / t).float().log_softmax(-1)


def tree_step(runner: TargetRunner, proposer, state: DecodeState, depth: int, budget: int, sampling: Sampling,
              clock: Callable[[str], None] = _no_clock) -> List[int]:
    """One tree step: the drafter's `depth` slots (one draft pass,
    ``proposer.propose_distribution``), the best tree of at most `budget` nodes of their paths,
    one target pass over it, the rule (:func:`~.tree_verify.verify_tree`), the cache and the
    drafter's context advanced by the accepted path. Returns the new tokens (the accepted path,
    then the target's token: 1 to depth + 1 of them) and advances `state` (one row, its target
    a :class:`~.step.OneRow`), as :func:`~.step.speculative_step`. `depth` 0: the target alone (nothing drafted)."""
    device, row = runner.device, state.target
    last, pos = state.lasts[0], state.positions[0]
    if depth > 0:
        dist = proposer.propose_distribution(last, pos, depth)
        logits, vocab = dist if isinstance(dist, tuple) else (dist, None)
        if logits.dim() != 2 or logits.shape[0] != depth:
            raise ValueError(f"drafter: propose_distribution(last_token, position, n={depth}) must return [n, V] "
                             f"logits, got shape {list(logits.shape)}")
        tree = build_tree(tree_logprobs(logits.to(device), sampling), budget,
                          None if vocab is None else vocab.to(device))
    else:
        tree = build_tree(torch.zeros(0, 1, device=device), 1)
    clock("draft")
    cached = int(row.cache.get_seq_length())
    ids, positions, mask = tree_inputs(tree, last, pos, cached, next(runner.target.parameters()).dtype)
    out_logits, hidden, row.cache = runner(ids, row.cache, rollback=row.rollback, position_ids=positions,
                                           attention_mask=mask)
    clock("verify")
    path, new = verify_tree(tree, out_logits[0], sampling)
    keep_path(row.cache, cached + 1, path)
    row.rollback(len(tree.tokens) - len(path))
    clock("other")
    rows = torch.tensor([0] + [1 + i for i in path], device=device)
    proposer.accept(hidden, rows, torch.arange(pos, pos + len(new), device=device))
    clock("draft")
    state.lasts, state.positions = [new[-1]], [pos + len(new)]
    return new
