"""Lossless DFlash speculative decoding with a Hugging Face causal LM as the target.

One step: the drafter writes B-1 tokens in one pass over the block
[last token, MASK x (B-1)]; the target verifies the block in one pass; the longest
prefix where the draft equals the target's own token is accepted, plus the target's
token at the first mismatch; the target KV cache is rolled back to the accepted length
and the accepted tokens' target hidden states are injected into the drafter's context.

At temperature 0 the target's token is its argmax; at T > 0 it is sampled from the
target's (temperature / top-k / top-p processed) distribution and a draft token is
accepted only when it equals that sample (sample-and-match), so every emitted token is
a sample of the target itself: the output distribution is exactly the target's.

The verify never reads how the drafts were chosen, so this holds for any proposal: a
DFlash2 drafter's candidate-selector path (greedy, proposer.draft_tokens) included, at
T = 0 and T > 0. The serving engines do more at T > 0 for DFlash2: they sample the path
from softmax(scores / T) over each slot's top-K candidates and verify with rejection
sampling against that q (accept with min(1, p/q), else resample from the residual), which
accepts more often than matching a greedy draft; that is not implemented here.
"""
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional

import torch
from torch import nn

from .config import target_text_config
from .drafter import DFlashDrafter
from .proposer import DFlashProposer
from .target import CacheRollback, TargetRunner, static_cache as new_static_cache, streamed_linears

__all__ = ["spec_generate", "target_generate", "speculative_step", "DecodeState", "GenerationResult",
           "sample_token", "check_sampling", "choose_block_size", "BlockSizeChoice"]

@dataclass
class GenerationResult:
    tokens: List[int]                      # generated tokens (prompt excluded)
    acceptance_lengths: List[int] = field(default_factory=list)  # tokens emitted per verify step
    block_size: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    time_to_first_token: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the target's token)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def histogram(self) -> List[int]:
        """histogram[j] = number of steps that accepted j draft tokens."""
        h = [0] * max(1, self.block_size)
        for n in self.acceptance_lengths:
            h[n - 1] += 1
        return h

    @property
    def other_time(self) -> float:
        return self.total_time - self.draft_time - self.verify_time

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_time if self.total_time > 0 else 0.0

    def summary(self) -> dict:
        return {"new_tokens": len(self.tokens), "steps": len(self.acceptance_lengths),
                "tau": self.tau, "histogram": self.histogram, "block_size": self.block_size,
                "tokens_per_second": self.tokens_per_second, "total_s": self.total_time,
                "draft_s": self.draft_time, "verify_s": self.verify_time, "other_s": self.other_time,
                "time_to_first_token_s": self.time_to_first_token}


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits [n, V]``: argmax at temperature 0, else a sample of
    the temperature / top-k / top-p processed distribution."""
    if temperature <= 0:
        return logits.argmax(-1)
    # Shifted by the row maximum and divided in float64, every finite temperature > 0 is
    # finite math: one so small that logits / T would overflow float32 (inf - inf = NaN in the
    # softmax) gives -inf to every token below the maximum, the greedy limit (ties shared).
    logits = logits.double()
    logits = ((logits - logits.amax(-1, keepdim=True)) / temperature).float()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and the most likely token whatever top_p is (below float32's range it reads as 0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class BlockSizeChoice:
    block_size: int
    expected_tokens: dict     # B -> expected tokens per step (1 + sum of the accepted-prefix profile)
    step_seconds: dict        # B -> measured draft + verify seconds of one step
    tokens_per_second: dict   # B -> expected_tokens / step_seconds
    profile_source: str


def _median_seconds(fn, reps: int = 5, warmup: int = 0) -> float:
    for _ in range(warmup):  # compiled passes: the compile and the CUDA-graph capture are not timed
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def choose_block_size(target, drafter: DFlashDrafter, context_len: int,
                      candidates=(1, 2, 3, 4, 6, 8, 10, 12, 16), stream_linears: bool = True,
                      static_cache: bool = False, static_cache_len: Optional[int] = None) -> BlockSizeChoice:
    """The verify block size B (<= the drafter's trained block) that maximises expected
    tokens per second on this machine:

        E(B) = 1 + sum_{j<B} P(the first j drafts are all accepted)   (the drafter's profile)
        c(B) = draft step (the whole trained block, the LM head on B - 1 slots) + target pass over B tokens
        B*   = argmax_B E(B) / c(B)

    B = 1 is the target alone (E = 1, no draft step, a pass without hidden states, as
    :func:`spec_generate` then runs it): chosen where drafting does not pay.

    The profile is ``drafter.acceptance_profile`` (held-out, written next to the checkpoint
    by training); without one nothing is timed and the trained block size is kept. c(B)
    is timed here, at `context_len` tokens of context (median of 5), with the linear layers
    and the cache as :func:`spec_generate` runs them (`stream_linears`, `static_cache`: a
    static cache of `static_cache_len` rows, default the context and the trained block; the
    compiled graphs are shaped by it, so spec_generate passes its own. On CUDA every B is
    compiled and warmed up before it is timed, one CUDA graph each: the candidates are then
    thinned to powers of two and the trained block, within torch._dynamo's recompile limit
    of 8). Each timed pass runs over B new tokens after the whole context, whatever the
    context's length."""
    with streamed_linears(target, drafter, enabled=stream_linears):
        trained = drafter.config.block_size
        profile = getattr(drafter, "acceptance_profile", None)
        sizes = sorted({b for b in candidates if b <= trained} | {trained})
        if not profile:
            return BlockSizeChoice(trained, {}, {}, {}, "none (no acceptance profile: the trained block size)")
        runner = TargetRunner(target, drafter.config.target_layer_ids, compiled_sizes=sizes if static_cache else ())
        if runner.compiles:
            sizes = [b for b in sizes if b & (b - 1) == 0 or b == trained]
        vocab = target_text_config(target.config).vocab_size  # a composite config keeps it in its text part
        context_len = max(1, context_len)
        context = torch.randint(0, vocab, (1, context_len), device=runner.device)
        # The verified tokens follow the context (a prompt may be shorter than the block).
        block = torch.randint(0, vocab, (1, trained), device=runner.device)
        cache = new_static_cache(target, static_cache_len or context_len + trained) if static_cache else None
        _, feats, cache = runner(context, cache)
        rollback = CacheRollback(cache, max(sizes))
        proposer = DFlashProposer(drafter, target, capacity=context_len + trained + 1)
        proposer.accept(feats, slice(0, context_len), torch.arange(context_len, device=runner.device))

        def verify(n):  # a pass over n tokens that are all rejected: the rollback is part of the step
            runner(block[:, :n], cache, hidden_states=n > 1, rollback=rollback)
            rollback(n)

        warmup = 3 if runner.compiles else 0
        expected, seconds, speed = {}, {}, {}
        for b in sizes:
            expected[b] = 1 + sum(profile[:b - 1])
            draft_s = _median_seconds(lambda: proposer.propose(1, context_len, b - 1)) if b > 1 else 0.0
            seconds[b] = draft_s + _median_seconds(lambda: verify(b), warmup=warmup)
            speed[b] = expected[b] / seconds[b]
        best = max(sizes, key=lambda b: speed[b])
        return BlockSizeChoice(best, expected, seconds, speed, "the drafter's held-out acceptance profile")


def prompt_ids(input_ids, target, caller: str) -> torch.Tensor:
    """`input_ids` ([n] or [1, n]: a list or an integer tensor) as a [1, n] long tensor on the
    target's device; anything else is a ValueError naming input_ids (not a reshape error, an
    IndexError inside the embedding, or floats silently cut to ints)."""
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError(f"input_ids is empty: {caller} needs at least one prompt token to continue")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got {str(ids.dtype).replace('torch.', '')}")
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{caller} decodes one sequence: input_ids must be [n] or [1, n], got shape "
                         f"{list(ids.shape)}" + (f" (batch {ids.shape[0]})" if ids.dim() == 2 else ""))
    rows = target.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise ValueError(f"input_ids holds the token id {low if low < 0 else high}, outside the target's "
                         f"vocabulary [0, {rows})")
    return ids.to(device=next(target.parameters()).device, dtype=torch.long)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Clear errors for sampling parameters outside their ranges."""
    if type(max_new_tokens) is not int or max_new_tokens < 1:  # bool too: True is no budget
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not 0 <= temperature < math.inf:  # also rejects NaN
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if type(top_k) is not int or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@dataclass
class DecodeState:
    """Where one sequence stands: the target's cache and how it rolls back (chosen once for
    it, after the prefill), the newest token (not yet seen by the target) and its position."""
    cache: object
    rollback: CacheRollback
    last: int
    pos: int


# Blocks of answer the drafter's context cache holds before it first grows (spec_generate).
_FIRST_BLOCKS = 4


def _no_clock(phase: str) -> None:
    pass


def speculative_step(runner: TargetRunner, proposer, state: DecodeState, verify_size: int, sampling: dict,
                     clock: Callable[[str], None] = _no_clock) -> List[int]:
    """One DFlash step: draft -> verify -> accept -> roll back -> inject. Returns the new
    tokens (the accepted drafts, then the target's own token) and advances `state`.
    `clock(phase)` is called as each phase ends, for the caller's timing only."""
    draft = proposer.propose(state.last, state.pos, verify_size - 1).to(runner.device) \
        if verify_size > 1 else torch.empty(0, dtype=torch.long, device=runner.device)
    clock("draft")
    block = torch.cat([torch.tensor([state.last], device=runner.device), draft])[None]
    logits, hidden, state.cache = runner(block, state.cache, rollback=state.rollback)
    clock("verify")
    target_tokens = sample_token(logits[0], **sampling).tolist()
    drafts = draft.tolist()
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]:
        a += 1
    new = target_tokens[:a + 1]  # the accepted drafts equal the target's tokens
    state.rollback(block.shape[1] - (a + 1))
    clock("other")
    if verify_size > 1:  # verify_size 1 is block size 1: the target alone, nothing drafts later
        proposer.accept(hidden, slice(0, a + 1), torch.arange(state.pos, state.pos + a + 1, device=block.device))
    clock("draft")
    state.last, state.pos = new[-1], state.pos + a + 1
    return new


class _PhaseClock:
    """Wall time per phase between calls (synchronising CUDA first)."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.totals = {"draft": 0.0, "verify": 0.0, "other": 0.0}
        self.t = time.perf_counter()

    def __call__(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.totals[phase] += now - self.t
        self.t = now


class _Emitter:
    """Appends tokens up to the budget / a stop token, streaming them as they come."""

    def __init__(self, res: GenerationResult, max_new_tokens: int, stop_token_ids, on_tokens, streamer):
        self.res, self.max_new, self.stops = res, max_new_tokens, set(int(t) for t in stop_token_ids)
        self.on_tokens, self.streamer = on_tokens, streamer

    def __call__(self, new: List[int]) -> bool:
        """True when generation is over."""
        kept = []
        for t in new:
            kept.append(t)
            if t in self.stops or len(self.res.tokens) + len(kept) >= self.max_new:
                break
        self.res.tokens.extend(kept)
        if self.on_tokens:
            self.on_tokens(kept)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(kept))
        return kept[-1] in self.stops or len(self.res.tokens) >= self.max_new


@torch.no_grad()
def spec_generate(target, drafter, input_ids, max_new_tokens: int, temperature: float = 0.0,
                  block_size=None, stop_token_ids: Iterable[int] = (), top_k: int = 0,
                  top_p: float = 1.0, generator: Optional[torch.Generator] = None, fused: bool = True,
                  on_tokens: Optional[Callable[[List[int]], None]] = None,
                  draft_window: Optional[int] = None, streamer=None,
                  stream_linears: bool = True, static_cache: bool = False) -> GenerationResult:
    """Speculative generation of up to `max_new_tokens` tokens after `input_ids` ([1, n] or a
    list): the loop around :func:`speculative_step`, which times and streams.

    `drafter` is a :class:`DFlashDrafter` or a proposer object with ``accept`` and
    ``propose`` (see :class:`DFlashProposer`). `block_size`: the verify block (int), "auto"
    (:func:`choose_block_size`) or None (the drafter's). `on_tokens` receives each step's
    new tokens; `streamer` is a Hugging Face streamer (``put``/``end``, e.g. TextStreamer).
    `draft_window` caps every drafter layer's window (long contexts; the authors'
    --draft-sliding-window-size): per query on causal layers, the last N context tokens on
    bidirectional ones (:func:`~dflash_ext.drafter.effective_windows`). `stream_linears`: the linear layers
    of the target and the drafter run as :func:`linear_rows` meanwhile (:func:`streamed_linears`:
    the verify passes, and B = 1 when that is the choice; False: F.linear everywhere).
    `static_cache`: the target's cache is a transformers StaticCache of the prompt, the budget
    and one block (the rollback lowers its length, :mod:`dflash_ext.rollback`), and on CUDA
    the verify passes of B tokens run compiled, captured in CUDA graphs (:func:`compiled_call`;
    not yet run on a GPU); on the CPU the same passes run eagerly."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    ids = prompt_ids(input_ids, target, "spec_generate")
    models = [target] + ([drafter] if isinstance(drafter, nn.Module) else [])
    with streamed_linears(*models, enabled=stream_linears):
        device = ids.device
        n_prompt = ids.shape[1]
        if isinstance(drafter, DFlashDrafter):
            trained = drafter.config.block_size
            if block_size == "auto":
                block_size = choose_block_size(target, drafter, n_prompt, stream_linears=stream_linears,
                                               static_cache=static_cache,
                                               static_cache_len=n_prompt + max_new_tokens + trained).block_size
            B = trained if block_size is None else block_size
            if type(B) is not int or B < 1:  # bool too: True is no block size
                raise ValueError(f"block_size must be an int >= 1 or 'auto', got {block_size!r}")
            if B == 1:  # nothing to draft: the target alone, without the drafter's hidden states
                return target_generate(target, ids, max_new_tokens, temperature=temperature,
                                       stop_token_ids=stop_token_ids, top_k=top_k, top_p=top_p, generator=generator,
                                       on_tokens=on_tokens, streamer=streamer, static_cache=static_cache)
            # The proposer runs the drafter over at least its trained block (DFlashProposer.propose).
            # Its cache is bounded by the budget but starts at the prompt and a few blocks, then
            # grows with the answer: an answer that stops early never pays for the budget.
            block = max(B, trained)
            proposer = DFlashProposer(drafter, target, capacity=n_prompt + max_new_tokens + block,
                                      initial_capacity=n_prompt + _FIRST_BLOCKS * block,
                                      fused=fused, draft_window=draft_window)
            layer_ids = drafter.config.target_layer_ids
        else:
            B, proposer, trained = block_size, drafter, 0
            layer_ids = getattr(drafter, "layer_ids", None)
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"block_size must be an int >= 1 or 'auto', got {B!r}")
        runner = TargetRunner(target, layer_ids, compiled_sizes=(B,) if static_cache else ())
        # Prompt, budget, one block of rejected rows (the trained block: the length choose_block_size compiled for).
        cache = new_static_cache(target, n_prompt + max_new_tokens + max(B, trained)) if static_cache else None
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        res = GenerationResult(tokens=[], block_size=B)
        if streamer is not None:
            streamer.put(ids.cpu())
        emit = _Emitter(res, max_new_tokens, stop_token_ids, on_tokens, streamer)

        start = time.perf_counter()
        clock = _PhaseClock(device)
        logits, hidden, cache = runner(ids, cache, last_logits_only=True)
        clock("verify")
        state = DecodeState(cache, CacheRollback(cache, B), int(sample_token(logits[0, -1:], **sampling)[0]), n_prompt)
        res.time_to_first_token = time.perf_counter() - start
        done = emit([state.last])
        if not done and B > 1:
            proposer.accept(hidden, slice(0, n_prompt), torch.arange(n_prompt, device=device))
        clock("draft")
        while not done:
            verify_size = min(B, max_new_tokens - len(res.tokens) + 1)  # near the budget: verify fewer
            new = speculative_step(runner, proposer, state, verify_size, sampling, clock)
            before = len(res.tokens)
            done = emit(new)
            res.acceptance_lengths.append(len(res.tokens) - before)  # the budget may cut the last step
            clock("other")
        if streamer is not None:
            streamer.end()
        res.total_time = time.perf_counter() - start
        res.draft_time, res.verify_time = clock.totals["draft"], clock.totals["verify"]
        return res


@torch.no_grad()
def target_generate(target, input_ids, max_new_tokens: int, temperature: float = 0.0,
                    stop_token_ids: Iterable[int] = (), top_k: int = 0, top_p: float = 1.0,
                    generator: Optional[torch.Generator] = None,
                    on_tokens: Optional[Callable[[List[int]], None]] = None, streamer=None,
                    stream_linears: bool = False, static_cache: bool = False) -> GenerationResult:
    """The target alone, one token per forward pass (the baseline, same sampling rules).
    `stream_linears`: its linear layers run through ops.skinny_linear (:func:`streamed_linears`;
    default off: F.linear, as HF `generate` runs them). `static_cache`: a StaticCache of the
    prompt and the budget, the one-token passes compiled on CUDA (CUDA graphs, as transformers'
    generate runs a static cache there; not yet run on a GPU), eager on the CPU."""
    with streamed_linears(target, enabled=stream_linears):
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = prompt_ids(input_ids, target, "target_generate")
        runner = TargetRunner(target, compiled_sizes=(1,) if static_cache else ())
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        res = GenerationResult(tokens=[], block_size=1)
        if streamer is not None:
            streamer.put(ids.cpu())
        emit = _Emitter(res, max_new_tokens, stop_token_ids, on_tokens, streamer)
        start = time.perf_counter()
        cache = new_static_cache(target, ids.shape[1] + max_new_tokens) if static_cache else None
        done = False
        while not done:
            logits, _, cache = runner(ids, cache, hidden_states=False, last_logits_only=True)
            t = int(sample_token(logits[0, -1:], **sampling)[0])
            if not res.tokens:
                res.time_to_first_token = time.perf_counter() - start
            res.acceptance_lengths.append(1)
            done = emit([t])
            ids = torch.tensor([[t]], device=ids.device)
        if streamer is not None:
            streamer.end()
        res.total_time = time.perf_counter() - start
        res.verify_time = res.total_time
        return res
