"""The drafter's context KV cache (:class:`DraftCache`) and each layer's attention window
(:func:`effective_windows`)."""
from typing import List, Optional

import torch

from ..model.config import DFlashConfig


def effective_windows(config: DFlashConfig, draft_window: Optional[int] = None) -> List[int]:
    """Per layer, its attention window W (0 = none): a sliding_attention layer its
    `sliding_window`, a full_attention layer none. A bidirectional layer sees the last W
    context rows and the whole block; a causal one (config.layer_causal) counts W per query:
    the query at position p sees the keys at p - W < k <= p. `draft_window` (like the
    authors' --draft-sliding-window-size) caps every layer's window, full ones included,
    for long contexts."""
    if draft_window is not None and draft_window < 1:
        raise ValueError(f"draft_window must be >= 1 (or None), got {draft_window}")
    if not draft_window:
        return config.layer_windows
    return [min(w, draft_window) if w else draft_window for w in config.layer_windows]


# Capacities a cache grows to are whole multiples of this many rows: the attention's key
# tile on the CPU and its smallest split on CUDA (256 keys), so no tile is left part-used.
CACHE_ROW_ALIGN = 256


class DraftCache:
    """The drafter's context KV cache: ``[N, batch * capacity, Hkv, D]`` for K and V;
    sequence b owns rows ``b * capacity .. (b+1) * capacity - 1`` and ``lengths[b]`` of
    them hold accepted tokens. Only accepted tokens advance it. The lengths live twice:
    on the host (``lengths``, for slot arithmetic without reading the device) and in the
    persistent device tensor ``lens`` that the attention reads, updated in place (so a
    captured CUDA graph sees the current lengths). ``windows`` and ``causal`` say per layer
    how its block queries attend (:func:`effective_windows`).

    ``max_capacity`` (>= capacity) lets it grow as a KV cache does: when a sequence needs
    more rows than ``capacity``, K and V are reallocated at twice the capacity (at least
    what is needed, in whole :data:`CACHE_ROW_ALIGN` rows, at most ``max_capacity``) and
    every sequence's rows copied to its new range; ``offsets`` is updated in place. So
    the memory follows the tokens accepted, not a budget. A growth replaces ``k`` and
    ``v`` (new tensors, new addresses) and changes ``capacity``: whoever holds them (a
    captured CUDA graph) must take them again. None: a fixed cache of ``capacity`` rows."""

    def __init__(self, config: DFlashConfig, batch_size: int, capacity: int, device, dtype,
                 draft_window: Optional[int] = None, max_capacity: Optional[int] = None):
        if max_capacity is not None and max_capacity < capacity:
            raise ValueError(f"max_capacity ({max_capacity}) must be >= capacity ({capacity})")
        self._dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)  # N, Hkv, D
        self.k = self.v = None
        self.capacity = 0
        self.max_capacity = capacity if max_capacity is None else max_capacity
        self.windows = effective_windows(config, draft_window)
        self.causal = config.layer_causal
        self._lengths = [0] * batch_size
        self.lens = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.offsets = torch.zeros(batch_size, device=device, dtype=torch.long)
        self._allocate(capacity, device, dtype)

    def _allocate(self, capacity: int, device, dtype) -> None:
        """K and V of `capacity` rows per sequence, the rows in use copied from the old ones."""
        N, Hkv, D = self._dims
        batch = len(self._lengths)
        k = torch.zeros((N, batch * capacity, Hkv, D), device=device, dtype=dtype)
        v = torch.zeros_like(k)
        used = max(self._lengths)
        if used:  # per sequence: its rows move from b * old capacity to b * new capacity
            for new, old in ((k, self.k), (v, self.v)):
                new.view(N, batch, capacity, Hkv, D)[:, :, :used].copy_(
                    old.view(N, batch, self.capacity, Hkv, D)[:, :, :used])
        self.k, self.v, self.capacity = k, v, capacity
        torch.mul(torch.arange(batch, device=device, dtype=torch.long), capacity, out=self.offsets)

    def reserve(self, b: int, n: int) -> None:
        """Make room for `n` tokens in sequence b: grow (see the class doc) when they do not
        fit the capacity; past ``max_capacity`` an error."""
        if n <= self.capacity:
            return
        if n > self.max_capacity:
            raise RuntimeError(f"drafter context cache is full: sequence {b} needs {n} tokens, "
                               f"more than its capacity of {self.max_capacity}")
        grown = -(-max(n, 2 * self.capacity) // CACHE_ROW_ALIGN) * CACHE_ROW_ALIGN
        self._allocate(min(grown, self.max_capacity), self.k.device, self.k.dtype)

    @property
    def lengths(self) -> tuple:
        """Accepted tokens per sequence (read-only: change them with set_length / advance)."""
        return tuple(self._lengths)

    def set_length(self, b: int, n: int) -> None:
        if not 0 <= n <= self.max_capacity:
            raise ValueError(f"sequence {b} cannot hold {n} tokens: the cache capacity is {self.max_capacity}")
        self.reserve(b, n)
        self._lengths[b] = n
        self.lens[b:b + 1].fill_(n)  # a device fill, no host round trip

    def advance(self, b: int, n: int) -> None:
        self.set_length(b, self._lengths[b] + n)

    def slots_for(self, b: int, n: int) -> torch.Tensor:
        """Cache rows for the next n tokens of sequence b, growing the cache when they do
        not fit (a cache full at ``max_capacity`` is an error)."""
        start = self._lengths[b]
        self.reserve(b, start + n)
        return torch.arange(b * self.capacity + start, b * self.capacity + start + n,
                            device=self.k.device, dtype=torch.long)
