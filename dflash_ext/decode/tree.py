"""Tree verification (issue 66): one DFlash draft pass, a tree of its best paths, one verify pass.

A DFlash drafter's slots are independent per-depth distributions, so one draft pass gives a
whole tree of candidates for free: the N most probable paths of the slots' product
distribution (:func:`~.tree_build.build_tree`). The target verifies the tree in one pass of
N + 1 tokens under an ancestor mask, the rule accepts the longest path the target itself
would have produced (:func:`~.tree_verify.verify_tree`: exact at every temperature), the
cache keeps that path's K/V (:func:`~.tree_verify.keep_path`), and the drafter receives the
path's target hidden states, as after a chain step.

- :class:`TreeProposer`: what :func:`tree_step` asks of a drafter, ``propose_distribution``
  (a :class:`DraftDistribution`: per-slot logits, and the draft vocabulary's token ids) and
  ``accept`` (:class:`~dflash_ext.draft.proposer.DFlashProposer`'s); :class:`DFlashTreeProposer`
  adapts a DFlashProposer to it.
- :func:`tree_step`: one step, the contract of :func:`~.step.speculative_step` (new tokens,
  the :class:`~.step.DecodeState` advanced).
- :func:`tree_generate`: a loop of them (a prefill, then steps to the budget or a stop token).
"""
from typing import Callable, List, NamedTuple, Optional, Protocol, runtime_checkable

import torch

from ..ops.linear import streamed_linears
from ..sampling import Sampling
from .output import GenerationResult, PhaseClock, RowOutput, check_sampling, prompt_ids
from .rollback import CacheRollback
from .runner import TargetRunner
from .step import DecodeState
from .tree_build import build_tree
from .tree_verify import check_tree_cache, check_tree_target, keep_path, tree_inputs, verify_tree

__all__ = ["DraftDistribution", "TreeProposer", "DFlashTreeProposer", "tree_step", "tree_generate",
           "tree_logprobs"]


class DraftDistribution(NamedTuple):
    """One draft pass's per-slot distributions: `logits [n, V']` (slot s predicts the token at
    depth s + 1 after the last accepted one, whatever was drafted before it) and `vocab`: the
    target token id of each of the V' columns (a drafter's draft vocabulary), or None (the
    columns are the target's token ids)."""
    logits: torch.Tensor
    vocab: Optional[torch.Tensor] = None


@runtime_checkable
class TreeProposer(Protocol):
    """What :func:`tree_step` drives: ``propose_distribution(last_token, position, n)`` returns
    a :class:`DraftDistribution` of n slots after `last_token` at `position`; ``accept`` takes
    the target hidden states of the accepted tokens (as :class:`~dflash_ext.draft.proposer.Proposer`'s,
    with `rows` a long tensor of the pass's rows: the root, then the accepted path's nodes)."""

    def accept(self, hidden_states, rows, positions: torch.Tensor) -> None: ...

    def propose_distribution(self, last_token: int, position: int, n: int) -> DraftDistribution: ...


class DFlashTreeProposer:
    """A :class:`~dflash_ext.draft.proposer.DFlashProposer` as a :class:`TreeProposer`: the
    draft pass of :meth:`DFlashProposer.propose` (the block [last, MASK x width], width at least
    the trained block's), up to the LM head's logits over the draft vocabulary
    (``DraftRuntime.draft_logits``), eagerly. Per-slot distributions that depend on the
    previous slot's token (a DFlash2 drafter's candidate selector) are not a product
    distribution: refused."""

    def __init__(self, proposer):
        runtime = proposer.runtime
        if getattr(runtime.drafter, "candidate_selector", None) is not None:
            raise NotImplementedError("tree drafting with a DFlash2 drafter: its slots' candidates follow the token "
                                      "drafted before them (the selector's walk), so a tree is not its slots' top-k")
        self.proposer, self.runtime = proposer, runtime
        self.layer_ids = proposer.layer_ids

    def reset(self, positions: int) -> None:
        self.proposer.reset(positions)

    def accept(self, hidden_states, rows, positions: torch.Tensor) -> None:
        self.proposer.accept(hidden_states, rows, positions)

    @torch.no_grad()
    def propose_distribution(self, last_token: int, position: int, n: int) -> DraftDistribution:
        p, runtime = self.proposer, self.runtime
        width = max(n, p.block_size - 1)
        if position + width >= p.position_limit:
            raise RuntimeError(f"a block at position {position} of {width + 1} tokens runs past the "
                               f"{p.position_limit} positions this proposer was made for")
        runtime.cover(position + width + 1)
        device = runtime.device
        ids = torch.full((1, width + 1), runtime.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = last_token
        positions = position + torch.arange(width + 1, device=device)[None]
        _, logits = runtime.draft_logits(ids, positions, n)
        return DraftDistribution(logits[0], runtime.vocab)


def tree_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The per-slot log-probabilities a tree is built from: the drafter's distribution at the
    generation's temperature (T = 0: at 1, its own calibration). Only the temperature: a
    top-k / top-p cut would tie every token it drops at -inf (the tree ranks candidates, the
    verify rule alone decides what is emitted)."""
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    return (logits.double() / t).float().log_softmax(-1)


def _no_clock(phase: str) -> None:
    pass


def tree_step(runner: TargetRunner, proposer, state: DecodeState, depth: int, budget: int, sampling: Sampling,
              clock: Callable[[str], None] = _no_clock) -> List[int]:
    """One tree step: the drafter's `depth` slots (one draft pass,
    ``proposer.propose_distribution``), the best tree of at most `budget` nodes of their paths,
    one target pass over it, the rule (:func:`~.tree_verify.verify_tree`), the cache and the
    drafter's context advanced by the accepted path. Returns the new tokens (the accepted path,
    then the target's token: 1 to depth + 1 of them) and advances `state`, as
    :func:`~.step.speculative_step`. `depth` 0: the target alone (nothing drafted)."""
    device = runner.device
    if depth > 0:
        dist = proposer.propose_distribution(state.last, state.pos, depth)
        logits, vocab = dist if isinstance(dist, tuple) else (dist, None)
        if logits.dim() != 2 or logits.shape[0] != depth:
            raise ValueError(f"drafter: propose_distribution(last_token, position, n={depth}) must return [n, V] "
                             f"logits, got shape {list(logits.shape)}")
        tree = build_tree(tree_logprobs(logits.to(device), sampling), budget,
                          None if vocab is None else vocab.to(device))
    else:
        tree = build_tree(torch.zeros(0, 1, device=device), 1)
    clock("draft")
    cached = int(state.cache.get_seq_length())
    ids, positions, mask = tree_inputs(tree, state.last, state.pos, cached, next(runner.target.parameters()).dtype)
    out_logits, hidden, state.cache = runner(ids, state.cache, rollback=state.rollback, position_ids=positions,
                                             attention_mask=mask)
    clock("verify")
    path, new = verify_tree(tree, out_logits[0], sampling)
    keep_path(state.cache, cached + 1, path)
    state.rollback(len(tree.tokens) - len(path))
    clock("other")
    rows = torch.tensor([0] + [1 + i for i in path], device=device)
    proposer.accept(hidden, rows, torch.arange(state.pos, state.pos + len(new), device=device))
    clock("draft")
    state.last, state.pos = new[-1], state.pos + len(new)
    return new


@torch.no_grad()
def tree_generate(target, drafter, input_ids, max_new_tokens: int, depth: Optional[int] = None, budget: int = 32,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None, stop_token_ids=(), fused: bool = True,
                  on_tokens: Optional[Callable] = None, stream_linears: bool = True) -> GenerationResult:
    """DFlash with tree verification, one prompt: a prefill, then :func:`tree_step` (trees of
    `depth` slots, None: the drafter's block size - 1, and at most `budget` nodes) until
    `max_new_tokens` or a stop token. `drafter`: a DFlashDrafter (a DFlashProposer is made
    for this generation) or a :class:`TreeProposer` object. Sampling as
    :func:`~.loop.spec_generate`'s (one rule at every temperature: :func:`~.tree_verify.verify_tree`).
    A target whose cache or attention cannot verify a tree is a NotImplementedError naming its
    family (:func:`~.tree_verify.check_tree_target`) before anything runs. The result's
    `block_size` is the tree's node budget + 1 (the pass's length). `stream_linears`: as
    spec_generate's (the target's and drafter's linear layers through skinny_linear on the CPU)."""
    from ..draft.proposer import DFlashProposer
    from ..model.drafter import DFlashDrafter

    sampling = check_sampling(max_new_tokens, temperature, top_k, top_p, "match", generator)
    if type(budget) is not int or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (the tree's nodes), got {budget!r}")
    check_tree_target(target)
    ids = prompt_ids(input_ids, target, "tree_generate")
    n_prompt = ids.shape[1]
    if isinstance(drafter, DFlashDrafter):
        depth = drafter.config.block_size - 1 if depth is None else depth
        block = max(depth + 1, drafter.config.block_size)
        proposer = DFlashTreeProposer(DFlashProposer(drafter, target, capacity=n_prompt + max_new_tokens + block,
                                                     fused=fused))
    else:
        if not isinstance(drafter, TreeProposer):
            raise ValueError("drafter must be a DFlashDrafter or a tree proposer object (with accept and "
                             f"propose_distribution methods), got {type(drafter).__name__}")
        if depth is None:
            raise ValueError("depth: a tree proposer object has no trained block to default to; give depth")
        proposer = drafter
        if hasattr(proposer, "reset"):
            proposer.reset(n_prompt + max_new_tokens + depth + 1)
    if type(depth) is not int or depth < 0:
        raise ValueError(f"depth must be an int >= 0 (the drafter's slots a tree spans), got {depth!r}")
    models = [target] + ([drafter] if isinstance(drafter, torch.nn.Module) else [])
    with streamed_linears(*models, enabled=stream_linears):
        return _tree_generate_one(target, proposer, ids, max_new_tokens, depth, budget, sampling, stop_token_ids,
                                  on_tokens)


def _tree_generate_one(target, proposer, ids, max_new_tokens, depth, budget, sampling, stop_token_ids, on_tokens):
    """tree_generate of one prompt `ids` [1, n], its arguments checked, its proposer made."""
    n_prompt, device = ids.shape[1], ids.device
    runner = TargetRunner(target, getattr(proposer, "layer_ids", None))
    out = RowOutput(ids, budget + 1, max_new_tokens, stop_token_ids, on_tokens, None)
    res = out.res
    clock = PhaseClock(device)
    logits, hidden, cache = runner(ids, None, last_logits_only=True)
    check_tree_cache(cache)
    clock("verify")
    state = DecodeState(cache, CacheRollback(cache, budget + 1), int(sampling.token(logits[0, -1:])[0]), n_prompt)
    done = out.emit([state.last])
    if not done:
        proposer.accept(hidden, slice(0, n_prompt), torch.arange(n_prompt, device=device))
    clock("draft")
    while not done:
        steps = min(depth, max_new_tokens - len(res.tokens) - 1)  # near the budget: a shallower tree
        new = tree_step(runner, proposer, state, steps, budget, sampling, clock)
        before = len(res.tokens)
        done = out.emit(new)
        res.acceptance_lengths.append(len(res.tokens) - before)
        clock("other")
    out.finish()
    res.draft_time, res.verify_time = clock.totals["draft"], clock.totals["verify"]
    return res
