"""The target side of the loop: a Hugging Face causal LM as DFlash calls it.

- :class:`TargetRunner`: one forward as the loop calls it (the cache argument's name,
  last-position logits for a prefill, only the hidden states the drafter reads);
- :class:`CacheRollback`: roll the target's cache back after a rejection, for every cache
  layer kind transformers has (full, sliding/chunked window, linear-attention conv and
  recurrent states, their mixes); :func:`crop_cache` for caches that crop;
- :func:`streamed_linears` / :func:`linear_rows`: the target's (and the drafter's) linear
  layers on few rows through ``ops.skinny_linear`` (the verify pass, the draft block).
"""
import contextlib
import functools
import inspect
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .hardware import skinny_linear_streams

__all__ = ["TargetRunner", "CacheRollback", "crop_cache", "cache_kwarg", "returned_cache", "linear_rows",
           "streamed_linears"]


def cache_kwarg(model) -> str:
    """The name of the KV-cache argument of a Hugging Face model's forward: recent
    transformers name it `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out):
    """The KV cache a Hugging Face forward returned (`cache` in recent transformers,
    `past_key_values` in older ones)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


class TargetRunner:
    """One target's forward as the loop calls it. The signature is inspected once
    (:func:`cache_kwarg`, `logits_to_keep`), and only the hidden states the drafter reads
    are asked for where transformers can select them (5.x takes a list of indices in
    `output_hidden_states`; the tuple keeps its layout, with None elsewhere); otherwise, or
    if the model returns None for one of them, all."""

    def __init__(self, target, layer_ids: Optional[Sequence[int]] = None):
        self.target = target
        self.device = next(target.parameters()).device
        self.cache_arg = cache_kwarg(target)
        self.can_keep_last = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.needed = [l + 1 for l in layer_ids] if layer_ids else []
        self.select = self.needed if self.needed and _CAN_SELECT_HIDDEN_STATES else True

    def __call__(self, ids: torch.Tensor, cache, hidden_states: bool = True, last_logits_only: bool = False,
                 rollback: Optional["CacheRollback"] = None):
        """(logits [1, n, V], hidden states or None, cache) of one pass over `ids` [1, n];
        `last_logits_only`: logits [1, 1, V] of the last position only (a prefill needs no
        more; as in `generate`, which also rounds them the same way then). `rollback`: the
        cache's :class:`CacheRollback` (a pass redone must be undone first; without one the
        cache must crop)."""
        want = self.select if hidden_states else False
        if rollback is not None:
            rollback.check_pass(ids.shape[1])
        keep = {"logits_to_keep": 1} if last_logits_only and self.can_keep_last else {}
        out = self.target(input_ids=ids, use_cache=True, output_hidden_states=want, **{self.cache_arg: cache}, **keep)
        hs = out.hidden_states
        if hidden_states and want is not True and any(hs is None or len(hs) <= i or hs[i] is None
                                                      for i in self.needed):
            self.select = True  # this model cannot select: ask for all from now on, and redo this pass
            if cache is not None:
                rollback(ids.shape[1]) if rollback is not None else _drop_tail(cache, ids.shape[1])
            return self(ids, cache, hidden_states, last_logits_only, rollback)
        return out.logits, hs, returned_cache(out)


def _can_select_hidden_states() -> bool:
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


_CAN_SELECT_HIDDEN_STATES = _can_select_hidden_states()


def crop_cache(cache, keep: int) -> None:
    """Roll a Hugging Face cache whose layers all crop (see :class:`CacheRollback`) back to
    its first `keep` tokens (transformers 5.x takes the negative number of tokens to drop)."""
    _drop_tail(cache, cache.get_seq_length() - keep)


def _drop_tail(cache, drop: int) -> None:
    if drop > 0:
        cache.crop(-drop)


def _cache_layer_kinds():
    """(layers a crop restores exactly, layers that keep a bounded state, `Cache.crop`) of
    the installed transformers."""
    from transformers import cache_utils as cu

    names = lambda *n: tuple(getattr(cu, x) for x in n if hasattr(cu, x))
    # Every token's K/V is kept (DSA adds an indexer key per token; a KV-shared layer keeps nothing).
    keeps_every_token = names("DynamicLayer", "DynamicIndexedLayer", "DummyLayer")
    # A window of K/V, or a conv + recurrent state: what was dropped or folded in cannot be
    # recovered by a crop, only recorded beforehand (transformers' `activate_past_recording`).
    bounded = names("DynamicSlidingWindowLayer", "LinearAttentionLayer",
                    "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer")
    return keeps_every_token, bounded, cu.Cache.crop


class CacheRollback:
    """Rolls one target cache back by the rejected tokens of each verify pass. The mechanism
    is chosen once per cache, after the prefill, from its layer kinds:

    - every layer keeps every token (full attention, DSA, KV-shared placeholders): a plain
      `crop` of the rejected tail; nothing recorded, nothing done on a full accept. Zero cost.
    - some layer keeps a bounded state (a sliding or chunked window, a linear-attention conv
      and recurrent state, alone or mixed with attention): transformers' own past recording,
      as its assisted and DFlash loops use it. During a pass of up to `max_tokens` tokens the
      window layers keep the extra tokens, the conv states their inputs, and the linear layers
      compute the recurrent state after each token (sequentially, instead of chunked: the cost);
      every step then crops, by 0 tokens too, which trims them back to their working size.

    A cache layer of another kind (static, quantized, a model's own class) or a cache that
    overrides `crop` (e.g. MiniMaxCache) is an error naming it, before any decoding."""

    def __init__(self, cache, max_tokens: int):
        self.cache, self.max_tokens = cache, max_tokens
        layers = getattr(cache, "layers", None)
        if layers is None:  # transformers 4.x: a DynamicCache of full-attention layers
            self.records = False
            return
        keeps_every_token, bounded, base_crop = _cache_layer_kinds()
        if type(cache).crop is not base_crop:
            raise NotImplementedError(
                f"cannot roll back a {type(cache).__name__}: it overrides `crop` (a cache of its own that "
                "transformers cannot roll back, e.g. MiniMax's lightning-attention cache)")
        kinds = [type(layer) for layer in layers]
        unknown = sorted({k.__name__ for k in kinds if k not in keeps_every_token + bounded})
        if unknown:
            raise NotImplementedError(
                f"cannot roll back the target's cache: layer kind(s) {', '.join(unknown)} "
                f"(supported: {', '.join(k.__name__ for k in keeps_every_token + bounded)})")
        self.records = any(k in bounded for k in kinds)
        if self.records:
            cache.activate_past_recording(recurrent_states_to_keep=max_tokens)
            for layer in layers:  # transformers' activation shares one history list among a layer's states
                if hasattr(layer, "recurrent_states_history"):
                    layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}

    def check_pass(self, n: int) -> None:
        """A pass of `n` tokens must fit the recording: it keeps the states after each of the
        last `max_tokens` tokens only, so a longer pass could not be undone exactly."""
        if self.records and n > self.max_tokens:
            raise ValueError(f"a pass of {n} tokens cannot be rolled back: the cache records the last "
                             f"{self.max_tokens} (CacheRollback's max_tokens)")

    def __call__(self, drop: int) -> None:
        """Undo the last `drop` tokens of the last pass (0: all were accepted)."""
        if not self.records:
            _drop_tail(self.cache, drop)
            return
        if drop > self.max_tokens:
            raise ValueError(f"cannot roll back {drop} tokens: the cache records the last {self.max_tokens}")
        self.cache.crop(-drop)


def linear_rows(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, through ops.skinny_linear where its streaming kernel runs (one pass over
    the weight: on the CPUs measured the library's GEMM costs about twice its one-row GEMV at
    2..8 rows, and its GEMV runs below the memory bandwidth on some:
    bench/results/history/notebook-2026.md §6); many rows (a prefill) stay on F.linear, and
    so does a call that wants gradients (the op has no backward: training keeps working)."""
    if skinny_linear_streams(x, layer.weight) and not ops.wants_grad(x, layer.weight, layer.bias):
        return ops.skinny_linear(x, layer.weight, layer.bias)
    return F.linear(x, layer.weight, layer.bias)


@contextlib.contextmanager
def streamed_linears(*models: nn.Module, enabled: bool = True):
    """Within: every `nn.Linear` of `models` runs as :func:`linear_rows` (the verify pass
    over B tokens, the drafter's block, one-token passes). Layers that already carry their
    own forward (another patch, a hook library) are left alone; all are restored on exit."""
    patched = []
    try:
        for model in models if enabled else ():
            for m in model.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__:
                    m.forward = functools.partial(linear_rows, m)
                    patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
