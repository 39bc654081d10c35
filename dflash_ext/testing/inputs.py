"""Random inputs of the dflash_ext ops, shared by the test suite, the benchmarks and the GPU
tools (as ``flashinfer.testing`` is for FlashInfer): reproducible (drawn on the CPU from a
seeded generator, then cast and moved), never zeros, weights scaled so that outputs are O(1).
One builder per op: ``make_project_inputs``, ``make_inject_inputs``, ``make_attention_inputs``
and ``make_linear_inputs`` (skinny_linear). The eager baselines the benchmarks time are
bench/baselines.py; the tests' tolerance rule is in python_tests/helpers.py.
"""
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, gen, dtype=torch.float32, device="cpu", std=1.0) -> torch.Tensor:
    """Standard normal values drawn on the CPU (reproducible), then cast and moved."""
    return (torch.randn(shape, generator=gen) * std).to(dtype=dtype, device=device)


def norm_weight(shape, gen, dtype, device) -> torch.Tensor:
    """RMSNorm gains around 1 (0.5 .. 1.5), never zero."""
    return (0.5 + torch.rand(shape, generator=gen)).to(dtype=dtype, device=device)


# project_features --------------------------------------------------------------------
def make_project_inputs(T: int, H: int, k: int, H_out: Optional[int] = None, *, dtype=torch.float32,
                        device="cpu", seed: int = 0, layout: str = "contiguous", eps: float = 1e-6):
    """Returns (features, fc_weight, norm_weight, eps).

    layout: "contiguous" (separate [T, H] tensors), "hidden_states" (slices ``hs[:, l, :]``
    of one [T, L, H] tensor, rows strided by L*H), "wide" (``big[:, j*H:(j+1)*H]`` column
    blocks of a [T, k*H + 5] tensor), "colstrided" (``big[:, ::2]``: last dim not contiguous).
    """
    g = make_gen(seed)
    H_out = H if H_out is None else H_out
    if layout == "contiguous":
        feats = [randn((T, H), g, dtype, device) for _ in range(k)]
    elif layout == "hidden_states":
        L = k + 2
        hs = randn((T, L, H), g, dtype, device)
        layers = torch.randperm(L, generator=g)[:k].tolist()
        feats = [hs[:, l, :] for l in layers]
    elif layout == "wide":
        big = randn((T, k * H + 5), g, dtype, device)
        feats = [big[:, 5 + j * H: 5 + (j + 1) * H] for j in range(k)]
    elif layout == "colstrided":
        feats = [randn((T, 2 * H), g, dtype, device)[:, ::2] for _ in range(k)]
    else:
        raise ValueError(layout)
    fc_weight = randn((H_out, k * H), g, dtype, device, std=1.0 / math.sqrt(k * H))
    return feats, fc_weight, norm_weight((H_out,), g, dtype, device), eps


# inject_context_kv -------------------------------------------------------------------
def rope_tables(P: int, D: int, gen, dtype, device, random_angles: bool = True):
    """cos/sin [P, D]. random_angles=True draws an independent angle per element (so the
    two halves differ and any half mix-up shows); False builds the usual HF tables."""
    if random_angles:
        ang = (torch.rand((P, D), generator=gen) * 2 - 1) * math.pi
    else:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        f = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq[None]
        ang = torch.cat([f, f], dim=-1)
    return ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device)


def random_slots(T: int, S: int, gen, skip_frac: float = 0.25, device="cpu") -> torch.Tensor:
    """T distinct cache rows in [0, S) in random order, about skip_frac of them -1."""
    assert S >= T
    slots = torch.randperm(S, generator=gen)[:T]
    if T > 1 and skip_frac > 0:
        skip = torch.rand(T, generator=gen) < skip_frac
        skip[0] = False  # always write at least one row
        slots[skip] = -1
    return slots.to(device)


@dataclass
class InjectInputs:
    ctx: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    eps: float = 1e-6

    def args(self, k_cache=None, v_cache=None):
        return (self.ctx, self.k_weight, self.v_weight, self.k_norm_weight, self.cos, self.sin,
                self.positions, self.slots, self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache, self.eps)

    def kwargs(self) -> Dict[str, object]:
        return dict(self.__dict__)


def make_inject_inputs(T: int, H: int, N: int, Hkv: int, D: int, *, S: Optional[int] = None,
                       P: Optional[int] = None, dtype=torch.float32, device="cpu", seed: int = 0,
                       skip_frac: float = 0.25, sentinel: float = float("nan"),
                       random_angles: bool = True) -> InjectInputs:
    """Random inject inputs; the caches are filled with `sentinel` (rows that must not be
    written keep it)."""
    g = make_gen(seed)
    S = T + 11 if S is None else S
    P = T + 37 if P is None else P
    ctx = randn((T, H), g, dtype, device)
    w_std = 1.0 / math.sqrt(H)
    k_weight = randn((N, Hkv * D, H), g, dtype, device, std=w_std)
    v_weight = randn((N, Hkv * D, H), g, dtype, device, std=w_std)
    k_norm = norm_weight((N, D), g, dtype, device)
    cos, sin = rope_tables(P, D, g, dtype, device, random_angles)
    positions = torch.randint(0, P, (T,), generator=g).to(device)
    slots = random_slots(T, S, g, skip_frac, device)
    k_cache = torch.full((N, S, Hkv, D), sentinel, dtype=dtype, device=device)
    v_cache = torch.full((N, S, Hkv, D), sentinel, dtype=dtype, device=device)
    return InjectInputs(ctx, k_weight, v_weight, k_norm, cos, sin, positions, slots, k_cache, v_cache)


# block_attention ---------------------------------------------------------------------
@dataclass
class AttentionInputs:
    q: torch.Tensor
    k_block: torch.Tensor
    v_block: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_offsets: torch.Tensor
    cache_lens: torch.Tensor
    scale: float
    window: int = 0
    causal: bool = False  # not in args() (the op's max_context and validate come first): pass causal=inp.causal
    symmetric: bool = False  # likewise: pass symmetric=inp.symmetric

    def args(self):
        return (self.q, self.k_block, self.v_block, self.k_cache, self.v_cache, self.cache_offsets,
                self.cache_lens, self.scale, self.window)

    def kwargs(self) -> Dict[str, object]:
        return dict(self.__dict__)


def make_attention_inputs(lens: Sequence[int], Bq: int, Hq: int, Hkv: int, D: int, *, window: int = 0,
                          causal: bool = False, dtype=torch.float32, device="cpu", seed: int = 0, gap: int = 3,
                          poison: bool = True, q_std: float = 1.5, symmetric: bool = False) -> AttentionInputs:
    """Sequences laid out one after another in the cache with `gap` rows between them.
    With poison=True every cache row outside the rows the op may read (each sequence's
    context rows some query sees: the last `window`, causal and symmetric the last
    `window - 1`) is NaN, so any out-of-range read shows up as NaN."""
    g = make_gen(seed)
    Bsz = len(lens)
    offsets, pos = [], gap
    for n in lens:
        offsets.append(pos)
        pos += n + gap
    S = max(pos, 1)
    q = randn((Bsz, Bq, Hq, D), g, dtype, device, std=q_std)
    k_block = randn((Bsz, Bq, Hkv, D), g, dtype, device)
    v_block = randn((Bsz, Bq, Hkv, D), g, dtype, device)
    k_cache = randn((S, Hkv, D), g, dtype, device)
    v_cache = randn((S, Hkv, D), g, dtype, device)
    if poison:
        readable = torch.zeros(S, dtype=torch.bool)
        for off, n in zip(offsets, lens):
            seen = window - 1 if causal or symmetric else window  # context rows the first query sees
            start = off + max(0, n - seen) if window > 0 else off
            readable[start:off + n] = True
        k_cache[~readable.to(device)] = float("nan")
        v_cache[~readable.to(device)] = float("nan")
    return AttentionInputs(q, k_block, v_block, k_cache, v_cache,
                           torch.tensor(offsets, dtype=torch.long, device=device),
                           torch.tensor(list(lens), dtype=torch.long, device=device),
                           D ** -0.5, window, causal, symmetric)


# skinny_linear -----------------------------------------------------------------------
def make_linear_inputs(M, N, K, *, bias=False, dtype=torch.float32, device="cpu", seed=0):
    """Returns (x [M, K], weight [N, K], bias [N] or None)."""
    g = make_gen(seed)
    x = randn((M, K), g, dtype, device)
    w = randn((N, K), g, dtype, device, std=K ** -0.5)
    b = randn((N,), g, dtype, device) if bias else None
    return x, w, b
