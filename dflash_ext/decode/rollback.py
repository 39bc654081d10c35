"""Rolling a target's Hugging Face cache back by the rejected tokens of a verify pass.

:class:`CacheRollback` picks the mechanism once per cache, from its layer kinds, for every
kind transformers 5.x builds: dynamic full attention, sliding / chunked windows,
linear-attention conv and recurrent states, their mixes, and the static cache (a fixed
buffer of `max_cache_len` rows, the cache `torch.compile` can capture). :func:`crop_cache`
for caches whose layers all crop.

A static layer rolls back by its length, not by a crop of tensors: transformers' own
``StaticLayer.crop(-n)`` lowers its `cumulative_length` (a tensor at a fixed address, so a
compiled graph reads it) and leaves the rejected rows in the buffer. Nothing reads them:
the next pass takes its positions from that length (the models' forward: `position_ids` =
`cache.get_seq_length()` + arange), writes its keys and values over those rows
(`index_copy_` at the same positions) before attending, and the causal mask of a static
layer (`get_mask_sizes`: every `max_cache_len` row, masked past each query's position)
hides the rows beyond. python_tests/decode/test_static_cache.py checks the result equals
the target's own greedy decoding.
"""
from typing import Optional

__all__ = ["CacheRollback", "crop_cache"]


def crop_cache(cache, keep: int) -> None:
    """Roll a Hugging Face cache whose layers all crop (see :class:`CacheRollback`) back to
    its first `keep` tokens (transformers 5.x takes the negative number of tokens to drop)."""
    drop_tail(cache, int(cache.get_seq_length()) - keep)


def drop_tail(cache, drop: int) -> None:
    """Drop the last `drop` tokens of a cache whose layers all crop (nothing for 0)."""
    if drop > 0:
        cache.crop(-drop)


def _cache_layer_kinds():
    """(layers a crop restores exactly, layers that keep a bounded state, static window
    layers, `Cache.crop`) of the installed transformers."""
    from transformers import cache_utils as cu

    names = lambda *n: tuple(getattr(cu, x) for x in n if hasattr(cu, x))
    # Every token's K/V is kept (DSA adds an indexer key per token; a KV-shared layer keeps
    # nothing); a static layer keeps them in its buffer, and its crop lowers its length.
    keeps_every_token = names("DynamicLayer", "DynamicIndexedLayer", "DummyLayer", "StaticLayer", "StaticIndexedLayer")
    # A window of K/V, or a conv + recurrent state: what was dropped or folded in cannot be
    # recovered by a crop, only recorded beforehand (transformers' `activate_past_recording`).
    bounded = names("DynamicSlidingWindowLayer", "LinearAttentionLayer",
                    "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
                    "LinearAttentionAndStaticFullAttentionLayer")
    # A static window rolls its buffer once full, and keeps no record: it crops only while
    # the whole cache fits in its window (its `is_croppable`).
    static_windows = names("StaticSlidingWindowLayer", "LinearAttentionAndStaticSlidingWindowAttentionLayer")
    return keeps_every_token, bounded, static_windows, cu.Cache.crop


class CacheRollback:
    """Rolls one target cache back by the rejected tokens of each verify pass. The mechanism
    is chosen once per cache, after the prefill, from its layer kinds:

    - every layer keeps every token (full attention, DSA, KV-shared placeholders, static
      full-attention layers): a plain `crop` of the rejected tail (of a static layer: its
      length, see the module notes); nothing recorded, nothing done on a full accept.
    - some layer keeps a bounded state (a sliding or chunked window, a linear-attention conv
      and recurrent state, alone or mixed with attention): transformers' own past recording,
      as its assisted and DFlash loops use it. During a pass of up to `max_tokens` tokens the
      window layers keep the extra tokens, the conv states their inputs, and the linear layers
      compute the recurrent state after each token (sequentially, instead of chunked: the cost);
      every step then crops, by 0 tokens too, which trims them back to their working size.
      (A recording linear-attention layer is not `is_compileable`: transformers' criterion,
      which :class:`~.runner.TargetRunner` follows before compiling.)

    A cache layer of another kind (quantized, a model's own class, a static sliding window
    that can fill) or a cache that overrides `crop` (e.g. MiniMaxCache) is an error naming
    it, before any decoding.

    Each pass that may be rolled back is announced first (:meth:`check_pass`; TargetRunner
    does it when given the rollback), and each such pass is rolled back once, by 0 to its
    length tokens: a second rollback of one pass, a negative one, or one larger than the
    pass would leave a cache no decoding can reach, so they are errors."""

    def __init__(self, cache, max_tokens: int):
        self.cache, self.max_tokens = cache, max_tokens
        self.pending: Optional[int] = None  # the length of the pass not yet rolled back
        layers = getattr(cache, "layers", None)
        if layers is None:  # transformers 4.x: a DynamicCache of full-attention layers
            self.records = False
            return
        keeps_every_token, bounded, static_windows, base_crop = _cache_layer_kinds()
        if type(cache).crop is not base_crop:
            raise NotImplementedError(
                f"cannot roll back a {type(cache).__name__}: it overrides `crop` (a cache of its own that "
                "transformers cannot roll back, e.g. MiniMax's lightning-attention cache)")
        kinds = [type(layer) for layer in layers]
        unknown = sorted({k.__name__ for k in kinds if k not in keeps_every_token + bounded + static_windows})
        if unknown:
            raise NotImplementedError(
                f"cannot roll back the target's cache: layer kind(s) {', '.join(unknown)} "
                f"(supported: {', '.join(k.__name__ for k in keeps_every_token + bounded + static_windows)})")
        windows = sorted({type(layer).__name__ for layer in layers
                          if type(layer) in static_windows and not layer.is_croppable})
        if windows:
            raise NotImplementedError(
                f"cannot roll back the target's static cache: its {', '.join(windows)} layers roll their window "
                "once it is full and keep no record of what they dropped (transformers crops them only while "
                "max_cache_len <= sliding_window); decode this target with the dynamic cache")
        self.records = any(k in bounded for k in kinds)
        if self.records:
            cache.activate_past_recording(recurrent_states_to_keep=max_tokens)
            for layer in layers:  # transformers' activation shares one history list among a layer's states
                if hasattr(layer, "recurrent_states_history"):
                    layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}

    def check_pass(self, n: int) -> None:
        """Announce a pass of `n` tokens that :meth:`__call__` may then undo. It must fit the
        recording (which keeps the states after each of the last `max_tokens` tokens only, so
        a longer pass could not be undone exactly), and the previous pass must have been
        rolled back (by 0 tokens if all were accepted)."""
        if self.pending is not None:
            raise RuntimeError(f"a pass of {n} tokens after a pass of {self.pending} that was not rolled back: call "
                               "the CacheRollback once after each pass (with 0 when every token is kept)")
        if self.records and n > self.max_tokens:
            raise ValueError(f"a pass of {n} tokens cannot be rolled back: the cache records the last "
                             f"{self.max_tokens} (CacheRollback's max_tokens)")
        self.pending = n

    def __call__(self, drop: int) -> None:
        """Undo the last `drop` tokens of the last pass (0: all were accepted)."""
        if not isinstance(drop, int) or isinstance(drop, bool) or drop < 0:
            raise ValueError(f"CacheRollback drops an int >= 0 of tokens of the last pass, got {drop!r}")
        if self.pending is None:
            raise RuntimeError(f"CacheRollback({drop}) without a pass to roll back: each pass is rolled back once, "
                               "after its check_pass (TargetRunner calls it when given the rollback)")
        if drop > self.pending:
            raise ValueError(f"cannot roll back {drop} tokens of a pass of {self.pending}")
        self.pending = None
        if self.records:
            self.cache.crop(-drop)  # by 0 too: trims the recorded past back to the working size
        else:
            drop_tail(self.cache, drop)
