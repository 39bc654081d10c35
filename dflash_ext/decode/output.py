"""What the decoding loops share, above them all (:mod:`.loop`'s single prompt and
:mod:`.batch`'s many): the input checks (:func:`prompt_ids`, :func:`check_sampling`), one
sequence's output as it grows (the budget, stop tokens, callbacks, streamer and timing:
:class:`RowOutput`), the phase clock (:class:`PhaseClock`) and the result
(:class:`GenerationResult`).
"""
import inspect
import numbers
import operator
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Iterable, List, Optional

import numpy as np
import torch

from ..sampling import DEFAULT_VERIFY, Sampling

__all__ = ["GenerationResult", "token_ids", "prompt_ids", "check_sampling", "check_on_tokens", "PhaseClock",
           "RowOutput"]

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


def token_ids(value, name: str = "input_ids") -> torch.Tensor:
    """`value` as an integer tensor of token ids, without copying a tensor: a tensor, a numpy
    array, or a list / tuple of ints (numpy's too). Anything else is a ValueError naming `name`
    and saying what was given (text, a tokenizer's output, an iterator, floats, bools), never a
    raw torch error."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} is text ({type(value).__name__}): it takes token ids; tokenize it first "
                         "(tokenizer(text)['input_ids'] or tokenizer.apply_chat_template)")
    if isinstance(value, Mapping):  # a tokenizer's BatchEncoding, a dict
        hint = "; pass its ['input_ids']" if "input_ids" in value else ""
        raise ValueError(f"{name} is a {type(value).__name__} (a mapping): it takes token ids{hint}")
    if isinstance(value, (list, tuple)):
        bad = next((i for i, t in enumerate(value) if not _token_like(t)), None)
        if bad is not None:
            raise ValueError(f"{name}[{bad}] is {_what(value[bad])}: a prompt is a sequence of integer token ids")
    elif not isinstance(value, (torch.Tensor, np.ndarray)):
        raise ValueError(f"{name} must be a list, tuple, tensor or numpy array of token ids, got {_what(value)}")
    try:  # an empty list holds no ids (as_tensor would call it float): the caller's "empty" error
        ids = torch.as_tensor(value) if len(value) else torch.empty(0, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError) as e:  # ragged rows, an object array
        raise ValueError(f"{name} must be a rectangular sequence of integer token ids ({e})") from None
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"{name} must hold integer token ids, got {str(ids.dtype).replace('torch.', '')}")
    return ids


def _token_like(t) -> bool:
    """A single token id as a list may hold it: an int (numpy's too), not a bool; or any
    tensor / array / list (its dtype and shape are checked on the tensor it makes)."""
    return isinstance(t, (numbers.Integral, torch.Tensor, np.ndarray, list, tuple)) and not isinstance(t, (bool, np.bool_))


def _what(value) -> str:
    """A short description of a value for an error message."""
    kind = type(value).__name__
    if isinstance(value, (str, bytes)):
        return f"text ({kind} {value!r:.40})"
    return f"{kind} {value!r}" if isinstance(value, (numbers.Number, bool, type(None))) else f"a {kind} object"


def prompt_ids(input_ids, target, caller: str) -> torch.Tensor:
    """One prompt (:func:`token_ids`: [n] or [1, n]) as a [1, n] long tensor on the target's
    device; anything else is a ValueError naming input_ids (not a reshape error, an
    IndexError inside the embedding, or floats silently cut to ints)."""
    ids = token_ids(input_ids)
    if ids.numel() == 0:
        raise ValueError(f"input_ids is empty: {caller} needs at least one prompt token to continue")
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


def check_on_tokens(on_tokens, batch: bool) -> None:
    """`on_tokens` is None or a callable that takes what the loop passes: ``(tokens)`` for one
    prompt, ``(row, tokens)`` for a batch; else a ValueError naming it now, not a TypeError
    after the first step."""
    if on_tokens is None:
        return
    if not callable(on_tokens):
        raise ValueError(f"on_tokens must be a callable (or None), got {_what(on_tokens)}")
    try:
        signature = inspect.signature(on_tokens)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind(*(["row", "tokens"] if batch else ["tokens"]))
    except TypeError:
        call = "on_tokens(row, tokens) for each row of a batch of prompts" if batch else "on_tokens(tokens) for one prompt"
        raise ValueError(f"on_tokens is called as {call}; the callable given takes {signature}") from None


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, verify: Optional[str] = None,
                   generator: Optional[torch.Generator] = None) -> Sampling:
    """The loops' way in: the budget checked (an int >= 1; not a bool, "1" or None), and the
    generation's :class:`~dflash_ext.sampling.Sampling` made (each field checked; `verify`
    None: the default rule), a ValueError naming what is wrong."""
    if type(max_new_tokens) is not int or max_new_tokens < 1:  # bool too: True is no budget
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return Sampling(temperature, top_k, top_p, DEFAULT_VERIFY if verify is None else verify, generator)


def stop_ids(stop_token_ids) -> set:
    """`stop_token_ids` (an iterable of token ids: ints, numpy's, 1-element integer tensors) as
    a set of ints; anything else (None, one bare id, a string, 2.7 that int() would cut to 2,
    True) is a ValueError naming it."""
    bad = ValueError(f"stop_token_ids must be an iterable of integer token ids, got {stop_token_ids!r}")
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
        raise bad
    ids = set()
    for t in stop_token_ids:
        if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
            raise bad
        try:
            ids.add(operator.index(t))
        except TypeError:
            raise bad from None
    return ids


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
        self.max_new, self.stops = max_new_tokens, stop_ids(stop_token_ids)
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
