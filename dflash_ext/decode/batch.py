"""Many prompts in one batch: :func:`batch_generate`, DFlash (or the target alone) over a
list of prompts of different lengths, each row accepting its own number of drafts per step.

How the rows share the target's cache (:class:`RaggedCache`, docs/decoding.md "Batches"):

- each prompt is prefilled alone (its first token and its drafter context exactly as a
  single-prompt run's), then the caches are stacked, left-padded to the longest;
- a verify pass runs the rows' blocks together, each at its own positions (`position_ids`),
  under a 2-D attention mask over the cache's columns: the padding and every row's rejected
  drafts are *holes*, masked, so a row never sees another row's tokens nor its own rejected
  ones. After the pass the common tail (the columns no row accepted) is cropped; the holes
  left are compacted away (one gather per layer, each row's kept columns right-aligned in
  order) once they would free a quarter of the columns (:data:`COMPACT_AT`);
- a row that finishes (a stop token, its budget) leaves the batch at once
  (``Cache.batch_select_indices``): it costs no more target nor drafter compute.

Holes need a cache whose layers keep every column as written and read them all under the
mask: full attention (``DynamicLayer``). A sliding window counts holes in its window and
drops columns by count; a linear-attention state folds every token in. Those families are a
clear error (:func:`check_batchable`): their prompts decode one by one.
"""
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..sampling import Draft, Sampling, split_draft
from .output import GenerationResult, PhaseClock, RowOutput, prompt_ids
from .rollback import drop_tail
from .runner import TargetRunner
from .verify import check_draft
from .step import DecodeState, speculative_step

__all__ = ["batch_generate", "prompt_rows", "per_row", "check_batchable", "RaggedCache", "RowProposers",
           "COMPACT_AT"]

# Compact the holes once doing so frees this fraction of the cache's columns: a compaction
# copies the cache once (about what one verify pass's attention reads), and it saves the
# freed columns at every later pass.
COMPACT_AT = 0.25


def prompt_rows(prompts, target, caller: str) -> Optional[List[torch.Tensor]]:
    """None where `prompts` is one prompt; else the batch's prompts as [1, n_i] long tensors on
    the target's device. The one rule (docs/decoding.md, "One prompt or many"): a list or tuple
    whose first item is a sequence (a list, a tuple, an [n] or [1, n] tensor or numpy array)
    is a batch, even of one, and every item must then be a prompt; a [b, n] tensor or array
    is a batch where b > 1; anything else is one prompt (a flat list of ints, an [n] tensor,
    or [1, n]: a tokenizer's ``return_tensors="pt"``). A bad row is an error naming it."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim != 2 or prompts.shape[0] < 2:
            return None
        rows = list(prompts)
    elif isinstance(prompts, (list, tuple)) and prompts and _is_sequence(prompts[0]):
        rows = list(prompts)
    else:  # an empty list: prompt_ids' error (no prompt token)
        return None
    out = []
    for i, row in enumerate(rows):
        try:
            if not _is_sequence(row):
                raise ValueError(f"a batch of prompts holds token-id sequences (prompts[0] is one), got {row!r:.40}")
            out.append(prompt_ids(row, target, caller))
        except ValueError as e:
            raise ValueError(f"prompts[{i}]: {e}") from None
    return out


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim > 0)


def per_row(value, n: int, name: str) -> list:
    """A per-prompt argument of a batch (e.g. the streamers): None for every row, or a list of n."""
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name}: a batch of {n} prompts takes a list of {n} (one per prompt) or None, "
                         f"got {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (list, tuple)) else ""))
    return list(value)


def row_callback(on_tokens: Optional[Callable[[int, List[int]], None]], row: int):
    """`on_tokens(row, tokens)` of a batch as one row's ``on_tokens(tokens)``."""
    return None if on_tokens is None else (lambda tokens: on_tokens(row, tokens))


def check_batchable(target) -> None:
    """A NotImplementedError naming the family where a batch's holes cannot be kept: every
    layer of the target's cache (as transformers builds it from the config) must be full
    attention (``DynamicLayer``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = target.config.get_text_config()
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config transformers cannot lay out: decided on the real cache (RaggedCache)
        return
    _check_layers(layers, config.model_type, DynamicLayer)


def _check_layers(layers, family: str, full) -> None:
    others = sorted({type(layer).__name__ for layer in layers if type(layer) is not full})
    if others:
        raise NotImplementedError(
            f"a batch of prompts on a {family} target: its cache holds {', '.join(others)} layers, which cannot "
            "be rolled back row by row (a sliding window counts another row's masked holes in its window, a "
            "linear-attention state folds every token in); decode its prompts one by one (one prompt per call)")


class RaggedCache:
    """The target's cache of a batch whose rows have different lengths (module notes):
    ``cache`` (a transformers DynamicCache, [rows, heads, columns, dim] per layer) and
    ``mask`` [rows, columns] (1: a token of the row, 0: a hole)."""

    def __init__(self, caches: Sequence, family: str = "target"):
        from transformers.cache_utils import DynamicLayer

        for cache in caches:
            _check_layers(getattr(cache, "layers", [cache]), family, DynamicLayer)
        lengths = [int(c.get_seq_length()) for c in caches]
        width = max(lengths)
        self.cache = caches[0]
        for i, layer in enumerate(self.cache.layers):  # left-padded: every row ends at the last column
            layer.keys = torch.cat([F.pad(c.layers[i].keys, (0, 0, width - n, 0)) for c, n in zip(caches, lengths)])
            layer.values = torch.cat([F.pad(c.layers[i].values, (0, 0, width - n, 0))
                                      for c, n in zip(caches, lengths)])
        device = self.cache.layers[0].keys.device
        self.mask = (torch.arange(width, device=device)[None] >= width - torch.tensor(lengths, device=device)[:, None])
        self.mask = self.mask.long()

    def attention_mask(self, n: int) -> torch.Tensor:
        """The 2-D mask of a pass of n new tokens per row: the cache's columns, then the block."""
        return torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], n)], 1)

    def pass_args(self, n: int, positions: torch.Tensor) -> dict:
        """A pass of n tokens per row at `positions` [rows, n]: each row at its own positions,
        under :meth:`attention_mask` (:class:`~.step.TargetRows`)."""
        return {"position_ids": positions, "attention_mask": self.attention_mask(n)}

    def keep(self, counts: Sequence[int], n: int) -> None:
        """After a pass of n tokens per row, row i keeps its first counts[i]: the tail no row
        kept is cropped, the rest of each row's rejected tokens become holes (:class:`~.step.TargetRows`)."""
        top = max(counts)
        drop_tail(self.cache, n - top)
        kept = torch.arange(top, device=self.mask.device)[None] < torch.tensor(counts, device=self.mask.device)[:, None]
        self.mask = torch.cat([self.mask, kept.long()], 1)
        self._maybe_compact()

    def select(self, rows: Sequence[int]) -> None:
        """Keep the batch rows `rows` (in this order): the others leave the cache."""
        index = torch.tensor(list(rows), device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        width = self.mask.shape[1]
        if width - int(self.mask.sum(1).max()) > COMPACT_AT * width:
            self.compact()

    def compact(self) -> None:
        """Move each row's tokens to the right end of the cache, in order, and drop the columns
        that are then holes in every row (one gather per layer's keys and values)."""
        counts = self.mask.sum(1)
        width, keep = self.mask.shape[1], int(counts.max())
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, width - keep:]  # holes first, tokens in order
        self.mask = self.mask.gather(1, order)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, t.gather(2, order[:, None, :, None].expand(t.shape[0], t.shape[1], keep,
                                                                                 t.shape[3])))


class RowProposers:
    """One proposer object per row (``accept``, ``propose``, e.g. the tests' OracleProposer) as
    a step calls them (:func:`~.step.speculative_step`): each sees its own row of the hidden
    states, as in a single run, and what each returns is checked (:func:`~.verify.check_draft`,
    the shapes) before the rows are stacked. One prompt is one row."""

    def __init__(self, proposers: Sequence, device, vocab_size: int):
        self.proposers, self.device, self.vocab_size = list(proposers), device, vocab_size

    def accept(self, hidden_states, rows: slice, positions: torch.Tensor, seq: int = 0, index: int = 0) -> None:
        own = None if hidden_states is None else tuple(None if h is None else h[index:index + 1] for h in hidden_states)
        self.proposers[seq].accept(own, rows, positions)

    def propose_rows(self, seqs, last_tokens, positions, n: int):
        """The rows' drafts stacked [rows, n], or a :class:`~dflash_ext.sampling.Draft` of
        them and their q stacked [rows, n, V] where the proposers return their q."""
        drafts = [split_draft(self.proposers[s].propose(t, p, n)) for s, t, p in zip(seqs, last_tokens, positions)]
        for tokens, q in drafts:
            check_draft(tokens, q, n, self.vocab_size, values=False)
        tokens = torch.stack([t.to(self.device) for t, _ in drafts])
        sampled = [q is not None for _, q in drafts]
        if not any(sampled):
            return tokens
        if not all(sampled):
            raise ValueError("drafter: the proposers of a batch return their q all or none (a Draft, or plain tokens)")
        return Draft(tokens, torch.stack([q.to(self.device) for _, q in drafts]))


@torch.no_grad()
def batch_generate(target, proposer, prompts: Sequence[torch.Tensor], max_new_tokens: int, block_size: int,
                   sampling: Sampling, stop_token_ids=(), on_tokens=None, streamers=None,
                   layer_ids=None) -> List[GenerationResult]:
    """One GenerationResult per prompt ([1, n_i] tensors), in order: DFlash over the batch with
    `proposer` (``accept(hidden states, rows, positions, seq, index)`` and ``propose_rows(seqs,
    last tokens, positions, n)``: a batched :class:`~dflash_ext.draft.proposer.DFlashProposer`
    or :class:`RowProposers`) at verify block `block_size`, or the target alone (`proposer`
    None, `block_size` 1). `sampling`: the generation's :class:`~dflash_ext.sampling.Sampling`,
    its `verify` the rule (:func:`~.verify.verify_rows`, every row in the same batched ops, each
    under its own q where ``propose_rows`` returns a :class:`~dflash_ext.sampling.Draft`). `on_tokens(row, tokens)` and ``streamers[row]``
    receive each row's tokens.
    A row's times are the batch's while it was in it (the batch's phases are shared)."""
    check_batchable(target)
    runner = TargetRunner(target, layer_ids)
    device, drafting = runner.device, proposer is not None
    streamers = per_row(streamers, len(prompts), "streamer")
    outs = [RowOutput(ids, block_size, max_new_tokens, stop_token_ids, row_callback(on_tokens, r), streamers[r])
            for r, ids in enumerate(prompts)]
    results: List[Optional[GenerationResult]] = [None] * len(prompts)
    clock = PhaseClock(device)

    def finish(r: int) -> None:
        res = results[r] = outs[r].finish()
        res.draft_time, res.verify_time = clock.totals["draft"], clock.totals["verify"]

    alive, caches, lasts, pos = [], [], [], []  # per row still in the batch: its id, cache, newest token, position
    for r, ids in enumerate(prompts):  # prefilled alone: each row's first token as in a single run
        logits, hidden, cache = runner(ids, None, hidden_states=drafting, last_logits_only=True)
        clock("verify")
        last = int(sampling.token(logits[0, -1:])[0])
        if not drafting:  # the target alone counts its prefill's token as a step, as target_generate does
            outs[r].res.acceptance_lengths.append(1)
        if outs[r].emit([last]):
            finish(r)
            continue
        n = ids.shape[1]
        if drafting:
            proposer.accept(hidden, slice(0, n), torch.arange(n, device=device), seq=r)
        clock("draft")
        alive.append(r), caches.append(cache), lasts.append(last), pos.append(n)
    if not alive:
        return results
    state = DecodeState(RaggedCache(caches, target.config.get_text_config().model_type), alive, lasts, pos)
    del caches
    while state.seqs:
        verify_size = min(block_size, max(max_new_tokens - len(outs[r].res.tokens) for r in state.seqs) + 1)
        news = speculative_step(runner, proposer, state, verify_size, sampling, clock)
        stay = []
        for i, (r, new) in enumerate(zip(state.seqs, news)):
            res, before = outs[r].res, len(outs[r].res.tokens)
            done = outs[r].emit(new)
            res.acceptance_lengths.append(len(res.tokens) - before)  # the budget may cut the last step
            if done:
                finish(r)
            else:
                stay.append(i)
        if len(stay) < len(news):  # finished rows leave: no more compute for them
            state.keep_rows(stay)
            if stay:
                state.target.select(stay)
        clock("other")
    return results
