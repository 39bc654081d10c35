"""The verify rule: which drafted tokens a verify pass accepts, and the token it emits after them.

The target's distribution at each position of the block is p_k, its processed distribution
(:func:`~dflash_ext.sampling.process_logits`: temperature, top-k, top-p, the same processing as
the drafter's q). Two rules (:data:`~dflash_ext.sampling.VERIFY_RULES`, the generation's
``Sampling.verify``),
both exact (every emitted sequence follows the target's own law):

- **rejection** (the default at T > 0; :func:`rejection_law`, :func:`rejection_sample`): the drafts x_k were sampled
  from the drafter's q_k (a :class:`~dflash_ext.sampling.Draft`; a proposer that returns
  plain tokens proposes them with certainty: q_k one-hot). In order, x_k is accepted with
  probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection a sample of the normalised
  residual max(0, p_k - q_k) is emitted and the step ends; when every draft is accepted, a
  sample of p at the last position (the bonus token). So P(emit x) = min(p, q)(x) +
  max(0, p - q)(x) = p(x) at every position (Leviathan et al. 2023; Chen et al. 2023), and a
  draft is accepted with probability sum_x min(p_k, q_k)(x), more often than it equals the
  target's own sample. A draft the target gives probability 0 (outside its top-k / top-p) is
  always rejected; a residual that is zero everywhere (p_k = q_k: a rejection there has
  probability 0, up to rounding) samples p_k.
- **match** (sample-and-match; greedy at T = 0 whatever the rule): the
  target's token at each position is its argmax at T = 0, else a sample of p_k; the longest
  prefix where the drafts equal those tokens is accepted, plus the target's token at the first
  mismatch. It never reads how the drafts were chosen (the proposer drafts its argmax).

:func:`verify` picks the rule for one sequence, :func:`verify_rows` for the rows of a batch
(:mod:`.batch`: each row under its own q, in the same batched ops); the loops read one thing
on the host per step either way (the emitted tokens, the accepted count among them).
"""
from typing import List, Optional

import torch

from ..sampling import Sampling

__all__ = ["verify", "verify_rows", "rejection_law", "rejection_sample", "check_draft"]

def check_draft(draft, draft_probs: Optional[torch.Tensor], n: int, vocab_size: int, values: bool) -> None:
    """What a proposer returned, as the verify rules read it, else a ValueError naming the
    drafter (not a torch error inside the rule, nor a q the rejection rule would silently
    misread): `draft [..., n]` a tensor of integer token ids, `draft_probs` None or [..., n, V] with V the
    target's vocabulary. With `values` (once per generation: it reads the device) also the
    values: ids in [0, V), q finite, non-negative, each slot summing to 1."""
    if not isinstance(draft, torch.Tensor) or draft.dim() == 0 or draft.shape[-1] != n:
        got = f"shape {list(draft.shape)}" if isinstance(draft, torch.Tensor) else type(draft).__name__
        raise ValueError(f"drafter: a proposer's propose(last_token, position, n={n}) must return a tensor of n token "
                         f"ids or a Draft of them, got {got}")
    if draft.dtype.is_floating_point or draft.dtype.is_complex or draft.dtype == torch.bool:
        raise ValueError(f"drafter: a proposer's draft must be integer token ids, got {draft.dtype}")
    if draft_probs is not None and draft_probs.shape != (*draft.shape, vocab_size):
        raise ValueError(f"drafter: a proposer's q (the Draft's probs) must be [n, V] = {[*draft.shape, vocab_size]} "
                         f"(one distribution over the target's {vocab_size} tokens per draft), got "
                         f"{list(draft_probs.shape)}")
    if not values or draft.numel() == 0:
        return
    if int(draft.min()) < 0 or int(draft.max()) >= vocab_size:
        raise ValueError(f"drafter: a proposer drafted a token id outside the target's vocabulary [0, {vocab_size}): "
                         f"{draft.tolist()}")
    if draft_probs is not None:
        q = draft_probs.float()
        sums = q.sum(-1)
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()) or bool(((sums - 1).abs() > 1e-3).any()):
            raise ValueError("drafter: a proposer's q must be a distribution per draft (finite, non-negative, summing "
                             f"to 1): got values in [{float(q.min()):g}, {float(q.max()):g}], sums in "
                             f"[{float(sums.min()):g}, {float(sums.max()):g}]")


def rejection_law(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor):
    """The rejection rule's law, batched over any leading dimensions: `draft [..., n]` the
    drafted tokens, `draft_probs [..., n, V]` the q each was sampled from (None: the drafts
    proposed with certainty, q one-hot), `target_probs [..., n + 1, V]` the target's processed
    p at the block's positions. Returns (accept [..., n]: min(1, p_k(x_k) / q_k(x_k)), 0 where
    p_k(x_k) = 0; residual [..., n + 1, V]: the unnormalised law of the token emitted after a
    rejection at k, max(0, p_k - q_k), or p_k where that is zero everywhere; at k = n, after
    every draft was accepted, p_n)."""
    n, V = draft.shape[-1], target_probs.shape[-1]
    p = target_probs.float()
    q = torch.nn.functional.one_hot(draft, V).float() if draft_probs is None else draft_probs.float()
    q = torch.cat([q, q.new_zeros(*q.shape[:-2], 1, V)], -2)  # nothing drafted at the bonus position: residual p
    index = draft[..., None]
    p_x, q_x = p[..., :n, :].gather(-1, index)[..., 0], q[..., :n, :].gather(-1, index)[..., 0]
    # q(x) = 0 (a proposer's draft it gave no weight): accepted where the target gives it any
    accept = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), (p_x > 0).float()).clamp(max=1)
    residual = (p - q).clamp_min(0)
    return accept, torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def rejection_sample(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None):
    """A draw of the rejection rule (:func:`rejection_law`, same arguments), with no host read:
    (accepted [...]: the number of leading drafts accepted, a; token [...]: the token emitted
    after them, from the residual at the first rejection, from p_n when all n are accepted)."""
    accept, residual = rejection_law(draft, draft_probs, target_probs)
    u = torch.rand(accept.shape, generator=generator, device=accept.device, dtype=accept.dtype)
    accepted = (u < accept).long().cumprod(-1).sum(-1)  # u in [0, 1): with probability accept; 0: never
    # one candidate per position (a few rows of one batched draw), the one at the first rejection emitted
    V = residual.shape[-1]
    candidates = torch.multinomial(residual.reshape(-1, V), 1, generator=generator).view(residual.shape[:-1])
    return accepted, candidates.gather(-1, accepted[..., None])[..., 0]


def verify_rows(drafts: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
                draft_probs: Optional[torch.Tensor] = None) -> List[List[int]]:
    """The tokens one verify pass emits in each row of a batch: the accepted drafts, then the
    target's token. `drafts [R, n]`: the drafted tokens; `logits [R, n + 1, V]`: the target's
    logits at the blocks' positions (each row's last accepted token, then its drafts);
    `sampling`: the generation's :class:`~dflash_ext.sampling.Sampling`, whose `verify` is the
    rule (at temperature 0 both are the greedy match); `draft_probs [R, n, V]`: each row's q
    under "rejection" (None: one-hot). Every row drawn in the same few batched ops; returns per row
    between 1 and n + 1 tokens, read on the host in one transfer."""
    n = drafts.shape[-1]
    if sampling.verify == "match" or sampling.greedy:  # sample-and-match (the module)
        rows = torch.cat([drafts, sampling.token(logits)], -1).tolist()
        out = []
        for row in rows:
            draft, target_tokens = row[:n], row[n:]
            a = 0
            while a < n and draft[a] == target_tokens[a]:
                a += 1
            out.append(target_tokens[:a + 1])  # the accepted drafts equal the target's tokens
        return out
    accepted, token = rejection_sample(drafts, draft_probs, sampling.probs(logits), sampling.generator)
    rows = torch.cat([accepted[:, None], drafts, token[:, None]], -1).tolist()
    return [row[1:1 + row[0]] + [row[-1]] for row in rows]


def verify(draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
           draft_probs: Optional[torch.Tensor] = None) -> List[int]:
    """:func:`verify_rows` of one sequence: `draft [n]`, `logits [n + 1, V]`, `draft_probs [n, V]`."""
    return verify_rows(draft[None], logits[None], sampling, None if draft_probs is None else draft_probs[None])[0]
