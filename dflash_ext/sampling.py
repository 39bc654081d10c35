"""Sampling, the target's and the drafter's alike, in one place: :class:`Sampling`, the one
value a generation samples by (temperature, top-k, top-p, the verify rule, the generator),
checked once where it is made and passed down; the one logit processing
(:func:`process_logits`), the greedy token (:func:`greedy_token`) and a token of it
(:func:`sample_token`); and the drafter's sampled draft at T > 0 (:func:`sample_draft`: each
slot's token and the distribution q it was drawn from, a :class:`Draft`, which the rejection
verify rule reads: :func:`~dflash_ext.decode.verify.verify`).

The drafter's q is processed exactly as the target's p (the same temperature, top-k and top-p),
over the draft vocabulary where the drafter has one (q is zero outside it), or for a DFlash2
drafter over each slot's top-K candidates along the selector's walk (softmax(scores / T), as
the serving engines sample it).
"""
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .model.layers import CandidateSelector

__all__ = ["VERIFY_RULES", "DEFAULT_VERIFY", "Sampling", "process_logits", "greedy_token", "sample_token", "Draft", "split_draft",
           "sample_draft"]

# The verify rules at T > 0 (dflash_ext.decode.verify): rejection sampling of sampled drafts
# (the default), or sample-and-match of greedy drafts. At T = 0 both are the greedy match.
VERIFY_RULES = ("rejection", "match")
DEFAULT_VERIFY = "rejection"


@dataclass(frozen=True)
class Sampling:
    """How a generation picks its tokens, one value for the target and the drafter: at
    `temperature` 0 the argmax, else a sample of the :func:`process_logits` distribution
    (`top_k`: 0 = off; `top_p`: 1 = off) drawn with `generator`; `verify`, the rule at T > 0
    (one of :data:`VERIFY_RULES`). Checked when made (a ValueError naming the field)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    verify: str = DEFAULT_VERIFY
    generator: Optional[torch.Generator] = None

    def __post_init__(self):
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {', '.join(map(repr, VERIFY_RULES))} (or None), "
                             f"got {self.verify!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def samples_drafts(self) -> bool:
        """The drafter samples its drafts and hands over their q (rejection sampling at T > 0);
        otherwise it drafts its argmax (the greedy match, or sample-and-match)."""
        return not self.greedy and self.verify == "rejection"

    def token(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits [..., V]`` (:func:`sample_token`)."""
        return sample_token(logits, self.temperature, self.top_k, self.top_p, self.generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is sampled from, ``[..., V]`` (float32; T > 0)."""
        return process_logits(logits, self.temperature, self.top_k, self.top_p).softmax(-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One index per row of the distributions ``probs [..., V]`` (:meth:`probs`'), drawn
        with the generator."""
        return _sample(probs, self.generator)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The logits ``[..., V]`` of the distribution a token is sampled from at ``temperature > 0``
    (float32; softmax gives its probabilities): divided by the temperature, the tokens outside
    the top-k (0: off) and outside the smallest prefix reaching probability top-p (1: off) at
    -inf, the most likely token always kept."""
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
    return logits


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim of ``logits [..., V]``. On the CPU, bf16/fp16 logits are
    widened to float32 first: the same index (the widening is exact, and ties resolve to the
    first maximum either way), found faster than by ATen's low-precision CPU argmax (which
    the greedy loop would pay on every verify block of the target's full vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def _sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One index per row of ``probs [..., V]`` (any leading shape)."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits [..., V]``: argmax at temperature 0, else a sample of the
    :func:`process_logits` distribution."""
    if temperature <= 0:
        return greedy_token(logits)
    return _sample(process_logits(logits, temperature, top_k, top_p).softmax(-1), generator)


class Draft(NamedTuple):
    """A sampled draft: `tokens [..., n]` and `probs [..., n, V]`, the distribution q each was
    drawn from over the target's vocabulary (float32; zero outside what the drafter proposes).
    A proposer that returns plain tokens proposes them with certainty (q one-hot)."""
    tokens: torch.Tensor
    probs: torch.Tensor


class DraftDistribution(NamedTuple):
    """One draft pass's per-slot distributions, what a tree is built from
    (:mod:`dflash_ext.decode.tree`): `logits [n, V']` (slot s predicts the token at depth
    s + 1 after the last accepted one, whatever was drafted before it) and `vocab`: the target
    token id of each of the V' columns (a drafter's draft vocabulary), or None (the columns
    are the target's token ids)."""
    logits: torch.Tensor
    vocab: Optional[torch.Tensor] = None


def split_draft(proposed):
    """What a proposer returned as (tokens, q): a :class:`Draft`'s, or plain tokens and None
    (proposed with certainty: q one-hot to the verify rule)."""
    return tuple(proposed) if isinstance(proposed, tuple) else (proposed, None)


def sample_draft(hidden: torch.Tensor, logits: torch.Tensor, vocab_size: int, sampling: Sampling,
                 vocab: Optional[torch.Tensor] = None, selector: Optional[CandidateSelector] = None,
                 anchor: Optional[torch.Tensor] = None) -> Draft:
    """The drafter's draft at T > 0 from the prediction slots' final hidden states
    ``hidden [Bsz, n, H]`` and LM-head ``logits [Bsz, n, V']`` (V' the draft vocabulary when
    `vocab` maps its rows to token ids): each slot's token sampled from q = the
    :func:`process_logits` distribution (`sampling`'s temperature > 0, top-k, top-p; its
    generator draws), or a DFlash2 drafter's `selector` walk from the `anchor` tokens [Bsz],
    each slot sampled from its candidates' processed scores after the token drawn before it.
    q is returned over the `vocab_size` token ids of the target (zero outside V' / the K
    candidates)."""
    temperature, top_k, top_p, generator = sampling.temperature, sampling.top_k, sampling.top_p, sampling.generator
    if not temperature > 0:
        raise ValueError(f"sample_draft samples at a temperature > 0, got {temperature!r} (greedy: dflash_ext.draft.head.greedy_draft)")
    Bsz, n = logits.shape[:2]
    if selector is None:
        q = process_logits(logits, temperature, top_k, top_p).softmax(-1)  # [Bsz, n, V']
        rows = _sample(q, generator)
        if vocab is None:
            return Draft(rows, q)
        return Draft(vocab[rows], q.new_zeros(Bsz, n, vocab_size).index_copy_(-1, vocab, q))
    slot_probs = []

    def choose(score: torch.Tensor) -> torch.Tensor:  # [Bsz, K] -> the candidate drawn, [Bsz]
        q = process_logits(score, temperature, top_k, top_p).softmax(-1)
        slot_probs.append(q)
        return _sample(q, generator)

    tokens, candidates = selector.walk(hidden, logits, anchor, vocab, choose)
    q = logits.new_zeros(Bsz, n, vocab_size, dtype=torch.float32)
    return Draft(tokens, q.scatter_(-1, candidates, torch.stack(slot_probs, 1)))
