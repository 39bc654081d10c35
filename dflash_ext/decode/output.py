"""What the decoding loops share, above them all (:mod:`.loop`'s single prompt and
:mod:`.batch`'s many): the input checks (:func:`prompt_ids`, :func:`check_sampling`), one
sequence's output as it grows (the budget, stop tokens, callbacks, streamer and timing:
:class:`RowOutput`), the phase clock (:class:`PhaseClock`) and the result
(:class:`GenerationResult`).
"""
import math
import time
from dataclasses import dataclass, field
from typing import List

import torch

__all__ = ["GenerationResult", "prompt_ids", "check_sampling", "PhaseClock", "RowOutput"]

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


class PhaseClock:
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


class RowOutput:
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
