"""Every run-time timing of the decoding side, in one place: the verify block size that
maximises expected tokens per second on this machine (:func:`choose_block_size`, ``block_size
="auto"``; :func:`choose_block_sizes`: several pairs timed in the same rounds). All time with
:func:`median_seconds` (several functions in turns: :func:`interleaved_median_seconds`, which
the demo's timing of the target alone uses too, dflash_ext/cli/demo.py). (The LM-head padding
is timed where it is decided, :func:`dflash_ext.ops.linear.lm_head_padding`: the draft step
sits below this layer.)"""
import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..draft.proposer import proposer_for
from ..model.config import target_text_config
from ..ops.linear import streamed_linears
from . import runner as runner_module
from .rollback import CacheRollback
from .runner import TargetRunner

__all__ = ["median_seconds", "interleaved_median_seconds", "BlockSizeChoice", "choose_block_size", "choose_block_sizes"]


@dataclass
class BlockSizeChoice:
    block_size: int
    expected_tokens: dict     # B -> expected tokens per step (walked tau, or 1 + sum of the profile; x rows)
    step_seconds: dict        # B -> measured draft + verify seconds of one step
    tokens_per_second: dict   # B -> expected_tokens / step_seconds
    profile_source: str

    @property
    def best_tokens_per_second(self) -> Optional[float]:
        """The expected tokens per second at the chosen block size (None: nothing timed)."""
        return self.tokens_per_second.get(self.block_size)


def median_seconds(fn, reps: int = 5, warmup: int = 0) -> float:
    """The median wall time of `reps` calls of `fn`, after `warmup` untimed ones."""
    return interleaved_median_seconds({None: fn}, reps, warmup)[None]


def interleaved_median_seconds(fns: dict, reps: int = 5, warmup: int = 0, around: Optional[dict] = None) -> dict:
    """{key: the median wall time of `reps` calls of fns[key]}, after `warmup` untimed calls of
    each. The calls are taken in rounds, one of each function per round, so that a machine whose
    speed drifts while they are timed (a shared CPU does) slows them alike instead of the last.
    `around`: {key: a function returning a context manager} entered, untimed, around each call of
    fns[key] (a setting that functions on one model cannot hold at once, such as streamed_linears)."""
    around = around or {}
    no_context = contextlib.nullcontext
    for _ in range(warmup):  # compiled passes: the compile and the CUDA-graph capture are not timed
        for key, fn in fns.items():
            with around.get(key, no_context)():
                fn()
    times = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            with around.get(key, no_context)():
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
    return {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}


@torch.no_grad()
def choose_block_size(target, drafter, context_len: int,
                      candidates=(1, 2, 3, 4, 6, 8, 10, 12, 16), stream_linears: bool = True,
                      static_cache: bool = False, static_cache_len: Optional[int] = None,
                      batch_size: int = 1) -> BlockSizeChoice:
    """The verify block size B (<= the drafter's trained block) that maximises expected
    tokens per second on this machine:

        E(B) = the drafter's held-out tokens per step as the loop walks at verify B (walked_tau),
               else 1 + sum_{j<B} P(the first j drafts are all accepted)   (its profile)
        c(B) = draft step (the whole trained block, the LM head on B - 1 slots) + target pass over B tokens
        B*   = argmax_B E(B) / c(B)

    B = 1 is the target alone (E = 1, no draft step, a pass without hidden states, as
    :func:`~.loop.spec_generate` then runs it): chosen where drafting does not pay.

    The profile is ``drafter.acceptance_profile`` (held-out, written next to the checkpoint
    by training); without one nothing is timed and the trained block size is kept. Where the
    checkpoint also has ``walked_tau`` (``eval --eval-stride 1 --save-acceptance``), E(B) is
    that: the loop drafts where its last step ended, after a miss more often than an anchor
    taken at random, so the profile over every anchor overstates E(B), the more the larger B. c(B)
    is timed here, at `context_len` tokens of context (median of 5, every B once a round), with the linear layers
    and the cache as :func:`~.loop.spec_generate` runs them (`stream_linears`, `static_cache`: a
    static cache of `static_cache_len` rows, default the context and the trained block; the
    compiled graphs are shaped by it, so spec_generate passes its own. On CUDA every B is
    compiled and warmed up before it is timed, one CUDA graph each: the candidates are then
    thinned to powers of two and the trained block, within torch._dynamo's recompile limit
    of 8). Each timed pass runs over B new tokens after the whole context, whatever the
    context's length.

    `batch_size` > 1: a batch's step (:mod:`.batch`): every row drafts and verifies B tokens in
    one batched draft pass and one batched verify pass (which cost more per token than a
    single one: a B chosen alone is not the batch's), so c(B) is timed over `batch_size` rows
    and the expected tokens per second are batch_size * E(B) / c(B)."""
    return choose_block_sizes({None: (target, drafter)}, context_len, candidates, stream_linears, static_cache,
                              static_cache_len, batch_size)[None]


@torch.no_grad()
def choose_block_sizes(pairs: dict, context_len: int,
                       candidates=(1, 2, 3, 4, 6, 8, 10, 12, 16), stream_linears: bool = True,
                       static_cache: bool = False, static_cache_len: Optional[int] = None,
                       batch_size: int = 1) -> dict:
    """{key: BlockSizeChoice} for `pairs` = {key: (target, drafter)}, each pair's block sizes
    chosen as :func:`choose_block_size` chooses them, the steps of every pair and B timed in the
    same rounds (the demo's dtypes: a drift of the machine's speed slows every pair alike)."""
    if type(context_len) is not int or context_len < 0:  # bool too
        raise ValueError(f"context_len must be an int >= 0, got {context_len!r}")
    bad = [b for b in candidates if type(b) is not int or b < 1]
    if bad:
        raise ValueError(f"candidates must be block sizes, ints >= 1, got {bad}")
    if static_cache_len is not None and not static_cache:  # a size for a cache that is not made
        raise ValueError(f"static_cache_len sizes the static cache: it needs static_cache=True, got "
                         f"static_cache_len={static_cache_len!r} with static_cache={static_cache!r}")
    settings = {key: functools.partial(streamed_linears, target, drafter, enabled=stream_linears)
                for key, (target, drafter) in pairs.items()}
    prepared = {}
    for key, (target, drafter) in pairs.items():
        with settings[key]():
            prepared[key] = _block_size_steps(target, drafter, max(1, context_len), candidates, static_cache,
                                              static_cache_len, batch_size)
    timed = {key: p for key, p in prepared.items() if p.steps}
    # one step of each pair and B per round: a drift while they are timed favours none of them
    seconds = interleaved_median_seconds({(key, b): fn for key, p in timed.items() for b, fn in p.steps.items()},
                                         warmup=max((p.warmup for p in timed.values()), default=0),
                                         around={(key, b): settings[key] for key, p in timed.items() for b in p.steps})
    choices = {}
    for key, p in prepared.items():
        if not p.steps:
            choices[key] = BlockSizeChoice(p.trained, {}, {}, {}, p.source)
            continue
        step_seconds = {b: seconds[key, b] for b in p.steps}
        speed = {b: p.expected[b] / step_seconds[b] for b in p.steps}
        choices[key] = BlockSizeChoice(max(p.steps, key=lambda b: speed[b]), p.expected, step_seconds, speed, p.source)
    return choices


@dataclass
class _BlockSizeSteps:
    trained: int
    source: str
    expected: dict = None   # B -> expected tokens per step
    steps: dict = None      # B -> one draft + verify step on the prefilled context (none: nothing to time)
    warmup: int = 0


def _block_size_steps(target, drafter, context_len: int, candidates, static_cache: bool,
                      static_cache_len: Optional[int], batch_size: int) -> _BlockSizeSteps:
    """choose_block_size's expected tokens per step and its timed steps for one pair, on a
    random prefilled context of `context_len` tokens; run inside the pair's linear-layer setting."""
    trained = drafter.config.block_size
    if static_cache_len is not None and (type(static_cache_len) is not int
                                         or static_cache_len < context_len + trained):
        raise ValueError(f"static_cache_len must be an int >= the timed context and one trained block "
                         f"({context_len} + {trained} = {context_len + trained} rows: the timed passes verify "
                         f"up to {trained} tokens after the context), got {static_cache_len!r}")
    profile = getattr(drafter, "acceptance_profile", None)
    sizes = sorted({b for b in candidates if b <= trained} | {trained})
    if not profile:
        return _BlockSizeSteps(trained, "none (no acceptance profile: the trained block size)")
    walked = getattr(drafter, "walked_tau", None)
    if walked is not None and len(walked) != trained - 1:  # set by hand: a loaded one is checked
        raise ValueError(f"drafter.walked_tau must hold block_size - 1 = {trained - 1} tokens per step (verify "
                         f"B = 2..{trained}), got {len(walked)}")
    runner = TargetRunner(target, drafter.config.target_layer_ids, compiled_sizes=sizes if static_cache else ())
    if runner.compiles:
        sizes = [b for b in sizes if b & (b - 1) == 0 or b == trained]
    vocab = target_text_config(target.config).vocab_size  # a composite config keeps it in its text part
    rows = list(range(batch_size))
    context = torch.randint(0, vocab, (batch_size, context_len), device=runner.device)
    # The verified tokens follow the context (a prompt may be shorter than the block).
    block = torch.randint(0, vocab, (batch_size, trained), device=runner.device)
    cache = runner_module.make_static_cache(target, static_cache_len or context_len + trained) if static_cache else None
    _, feats, cache = runner(context, cache)
    rollback = CacheRollback(cache, max(sizes))
    proposer = proposer_for(drafter, target, capacity=context_len + trained + 1, batch_size=batch_size)
    for r in rows:
        proposer.accept(feats, slice(0, context_len), torch.arange(context_len, device=runner.device), seq=r, index=r)

    def draft(b):
        if batch_size == 1:
            return proposer.propose(1, context_len, b - 1)
        return proposer.propose_rows(rows, [1] * batch_size, [context_len] * batch_size, b - 1)

    def verify(n):  # a pass over n tokens that are all rejected: the rollback is part of the step
        runner(block[:, :n], cache, hidden_states=n > 1, rollback=rollback)
        rollback(n)

    step = lambda b: (draft(b) if b > 1 else None, verify(b))
    expected = {b: batch_size * ((1 + sum(profile[:b - 1])) if walked is None or b == 1 else walked[b - 2])
                for b in sizes}
    source = "the drafter's held-out acceptance profile" if walked is None else \
        "the drafter's held-out tokens per step as the loop walks"
    return _BlockSizeSteps(trained, source, expected, {b: (lambda b=b: step(b)) for b in sizes},
                           warmup=3 if runner.compiles else 0)
