"""The decoding loops: :func:`spec_generate` (DFlash speculative decoding: a prefill, then
:func:`~.step.speculative_step` until the budget or a stop token) and :func:`target_generate`
(the target alone, one token per pass: the baseline, same sampling rules), with what they
share: the input checks (:func:`prompt_ids`, :func:`check_sampling`), the output as it grows
(the budget, stop tokens, callbacks, streamer and timing: :class:`_Output`) and the result
(:class:`GenerationResult`).
"""
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional

import torch
from torch import nn

from ..draft.proposer import DFlashProposer
from ..model.drafter import DFlashDrafter
from ..ops.linear import streamed_linears
from . import runner as runner_module
from .autotune import choose_block_size
from .rollback import CacheRollback
from .runner import TargetRunner
from .step import DecodeState, speculative_step
from .verify import sample_token

__all__ = ["spec_generate", "target_generate", "GenerationResult", "prompt_ids", "check_sampling"]


@dataclass
class GenerationResult:
    """What a loop returns: the tokens generated (prompt excluded), the tokens each verify step
    emitted (accepted drafts + the target's token; 1 per pass for the target alone), the block
    size verified, and wall times (draft, verify, total, to the first token) in seconds."""
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


# Blocks of answer the drafter's context cache holds before it first grows (spec_generate).
_FIRST_BLOCKS = 4


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


class _Output:
    """One generation's output as it grows: the result, the budget and the stop tokens, the
    callbacks (`on_tokens`, a Hugging Face `streamer`: ``put`` / ``end``) and the wall clock
    from the prompt on."""

    def __init__(self, ids: torch.Tensor, block_size: int, max_new_tokens: int, stop_token_ids, on_tokens, streamer):
        self.res = GenerationResult(tokens=[], block_size=block_size)
        self.max_new, self.stops = max_new_tokens, set(int(t) for t in stop_token_ids)
        self.on_tokens, self.streamer = on_tokens, streamer
        if streamer is not None:
            streamer.put(ids.cpu())
        self.start = time.perf_counter()

    def emit(self, new: List[int]) -> bool:
        """Append `new` up to the budget / a stop token and stream it; True when generation is over."""
        res = self.res
        if not res.tokens:
            res.time_to_first_token = time.perf_counter() - self.start
        kept = []
        for t in new:
            kept.append(t)
            if t in self.stops or len(res.tokens) + len(kept) >= self.max_new:
                break
        res.tokens.extend(kept)
        if self.on_tokens:
            self.on_tokens(kept)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(kept))
        return kept[-1] in self.stops or len(res.tokens) >= self.max_new

    def finish(self) -> GenerationResult:
        if self.streamer is not None:
            self.streamer.end()
        self.res.total_time = time.perf_counter() - self.start
        return self.res


@torch.no_grad()
def spec_generate(target, drafter, input_ids, max_new_tokens: int, temperature: float = 0.0,
                  block_size=None, stop_token_ids: Iterable[int] = (), top_k: int = 0,
                  top_p: float = 1.0, generator: Optional[torch.Generator] = None, fused: bool = True,
                  on_tokens: Optional[Callable[[List[int]], None]] = None,
                  draft_window: Optional[int] = None, streamer=None,
                  stream_linears: bool = True, static_cache: bool = False) -> GenerationResult:
    """Speculative generation of up to `max_new_tokens` tokens after `input_ids` ([1, n] or a
    list): the loop around :func:`~.step.speculative_step`, which times and streams.

    `drafter` is a :class:`~dflash_ext.model.drafter.DFlashDrafter` or a proposer object with
    ``accept`` and ``propose`` (see :class:`~dflash_ext.draft.proposer.DFlashProposer`).
    `block_size`: the verify block (int), "auto" (:func:`~.autotune.choose_block_size`) or None
    (the drafter's). `on_tokens` receives each step's new tokens; `streamer` is a Hugging Face
    streamer (``put``/``end``, e.g. TextStreamer). `draft_window` caps every drafter layer's
    window (long contexts; the authors' --draft-sliding-window-size): per query on causal
    layers, the last N context tokens on bidirectional ones
    (:func:`~dflash_ext.draft.cache.effective_windows`). `stream_linears`: the linear layers of
    the target and the drafter run through skinny_linear where it streams
    (:func:`~dflash_ext.ops.linear.streamed_linears`: the verify passes, and B = 1 when that is
    the choice; False: F.linear everywhere). `static_cache`: the target's cache is a
    transformers StaticCache of the prompt, the budget and one block (the rollback lowers its
    length, :mod:`.rollback`), and on CUDA the verify passes of B tokens run compiled, captured
    in CUDA graphs (:func:`~.runner.compiled_call`); on the CPU the same passes run eagerly."""
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
        cache = runner_module.static_cache(target, n_prompt + max_new_tokens + max(B, trained)) \
            if static_cache else None
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        out = _Output(ids, B, max_new_tokens, stop_token_ids, on_tokens, streamer)
        res = out.res
        clock = _PhaseClock(device)
        logits, hidden, cache = runner(ids, cache, last_logits_only=True)
        clock("verify")
        state = DecodeState(cache, CacheRollback(cache, B), int(sample_token(logits[0, -1:], **sampling)[0]), n_prompt)
        done = out.emit([state.last])
        if not done and B > 1:
            proposer.accept(hidden, slice(0, n_prompt), torch.arange(n_prompt, device=device))
        clock("draft")
        while not done:
            verify_size = min(B, max_new_tokens - len(res.tokens) + 1)  # near the budget: verify fewer
            new = speculative_step(runner, proposer, state, verify_size, sampling, clock)
            before = len(res.tokens)
            done = out.emit(new)
            res.acceptance_lengths.append(len(res.tokens) - before)  # the budget may cut the last step
            clock("other")
        out.finish()
        res.draft_time, res.verify_time = clock.totals["draft"], clock.totals["verify"]
        return res


@torch.no_grad()
def target_generate(target, input_ids, max_new_tokens: int, temperature: float = 0.0,
                    stop_token_ids: Iterable[int] = (), top_k: int = 0, top_p: float = 1.0,
                    generator: Optional[torch.Generator] = None,
                    on_tokens: Optional[Callable[[List[int]], None]] = None, streamer=None,
                    stream_linears: bool = False, static_cache: bool = False) -> GenerationResult:
    """The target alone, one token per forward pass (the baseline, same sampling rules).
    `stream_linears`: its linear layers run through skinny_linear where it streams
    (:func:`~dflash_ext.ops.linear.streamed_linears`; default off: F.linear, as HF `generate`
    runs them). `static_cache`: a StaticCache of the prompt and the budget, the one-token
    passes compiled on CUDA (CUDA graphs, as transformers' generate runs a static cache there),
    eager on the CPU."""
    with streamed_linears(target, enabled=stream_linears):
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = prompt_ids(input_ids, target, "target_generate")
        runner = TargetRunner(target, compiled_sizes=(1,) if static_cache else ())
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        out = _Output(ids, 1, max_new_tokens, stop_token_ids, on_tokens, streamer)
        cache = runner_module.static_cache(target, ids.shape[1] + max_new_tokens) if static_cache else None
        done = False
        while not done:
            logits, _, cache = runner(ids, cache, hidden_states=False, last_logits_only=True)
            t = int(sample_token(logits[0, -1:], **sampling)[0])
            out.res.acceptance_lengths.append(1)
            done = out.emit([t])
            ids = torch.tensor([[t]], device=ids.device)
        res = out.finish()
        res.verify_time = res.total_time
        return res
