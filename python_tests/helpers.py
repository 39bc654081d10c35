"""Shared helpers of the dflash_ext test suite: device/dtype parameters, the tolerance
rule, and the random input builders of every op (written once, used by every test file;
the fixtures live in conftest.py).

Tolerance rule
--------------
* float32: compare to the fp32 reference with ``rtol = 1e-4`` and ``atol = 1e-4 * max|ref|``.
* bfloat16 / float16 (the FA3 idiom): ``|ours - ref32| <= 2 * |ref_lowp - ref32| + atol``
  elementwise, where ``ref32`` is the reference run in fp32 on the same low-precision
  inputs and ``ref_lowp`` the reference run in the input dtype, and
  ``atol = ATOL_SCALE[dtype] * max|ref32|`` (covers one rounding of the output).
"""
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import pytest
import torch

import dflash_ext
from dflash_ext import reference

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_setup_module():
    """setup.py as a module (its setup() call only runs under __main__): the build description."""
    spec = importlib.util.spec_from_file_location("dflash_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]

# Tolerances, relative to the largest magnitude of the reference output.
FP32_RTOL = 1e-4
FP32_ATOL_SCALE = 1e-4
ATOL_SCALE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


# --------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------
def assert_close(out: torch.Tensor, ref32: torch.Tensor, ref_lowp: Optional[torch.Tensor] = None,
                 what: str = "output") -> None:
    """Check `out` against the reference with the dtype's tolerance rule (see module doc).

    `ref32` is the reference computed in fp32 (cast to the input dtype, as the reference
    returns it); `ref_lowp` the reference computed in the input dtype (needed for bf16/fp16).
    """
    assert out.shape == ref32.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    assert out.dtype == ref32.dtype, f"{what}: dtype {out.dtype} != {ref32.dtype}"
    if out.numel() == 0:
        return
    o, r = out.detach().float().cpu(), ref32.detach().float().cpu()
    assert torch.isfinite(r).all(), f"{what}: the reference itself is not finite (bad test inputs)"
    assert torch.isfinite(o).all(), f"{what}: {int((~torch.isfinite(o)).sum())} non-finite values"
    mag = r.abs().max().item()
    if out.dtype == torch.float32:
        torch.testing.assert_close(o, r, rtol=FP32_RTOL, atol=FP32_ATOL_SCALE * mag + 1e-30,
                                   msg=lambda m: f"{what} (fp32): {m}")
        return
    assert ref_lowp is not None, "low-precision comparisons need the reference run in that dtype"
    lp = ref_lowp.detach().float().cpu()
    atol = ATOL_SCALE[out.dtype] * mag
    err = (o - r).abs()
    bound = 2 * (lp - r).abs() + atol
    bad = err > bound
    if bad.any():
        i = int((err - bound).flatten().argmax())
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), err.shape))
        raise AssertionError(
            f"{what} ({out.dtype}): {int(bad.sum())}/{err.numel()} elements outside "
            f"2*|ref_lowp - ref32| + {atol:.3g}; worst at {idx}: ours={o[idx].item():.6g} "
            f"ref32={r[idx].item():.6g} ref_lowp={lp[idx].item():.6g} (max|err|={err.max().item():.3g})")


def check_op(op: Callable, ref_fn: Callable, *args, **kwargs) -> torch.Tensor:
    """Run `op(*args)`, compare with `ref_fn(*args)` (fp32 compute, plus the input-dtype
    compute for bf16/fp16) and return the op's output."""
    out = op(*args, **kwargs)
    ref32 = ref_fn(*args, **kwargs)
    lowp = None
    if out.dtype != torch.float32:
        lowp = ref_fn(*args, **kwargs, compute_dtype=out.dtype)
    assert_close(out, ref32, lowp)
    return out


# --------------------------------------------------------------------------------------
# Random input builders (never zeros; weights scaled so outputs are O(1))
# --------------------------------------------------------------------------------------
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


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_inject(inp: InjectInputs, op: Callable = dflash_ext.inject_context_kv) -> None:
    """Run the op in place on inp's (sentinel-filled) caches and check: rows of skipped or
    absent slots still hold the sentinel bit for bit, written rows match the reference."""
    sentinel_k, sentinel_v = inp.k_cache.clone(), inp.v_cache.clone()
    op(*inp.args())
    kc, vc = inp.k_cache, inp.v_cache
    S = kc.shape[1]
    written = inp.slots[inp.slots >= 0].cpu()
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[written] = False
    for name, got, before in (("k_cache", kc, sentinel_k), ("v_cache", vc, sentinel_v)):
        assert same_or_both_nan(got[:, untouched.to(got.device)], before[:, untouched.to(got.device)]), \
            f"{name}: rows that must not be written were modified"
    if written.numel() == 0:
        return
    refs = {}
    compute = [torch.float32] + ([kc.dtype] if kc.dtype != torch.float32 else [])
    for cd in compute:
        rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
        reference.inject_context_kv(*inp.args(rk, rv), compute_dtype=cd)
        refs[cd] = (rk, rv)
    w = written.to(kc.device)
    for i, (name, got) in enumerate((("k_cache", kc), ("v_cache", vc))):
        lowp = refs[kc.dtype][i][:, w] if kc.dtype != torch.float32 else None
        assert_close(got[:, w], refs[torch.float32][i][:, w], lowp, what=f"{name} written rows")


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

    def args(self):
        return (self.q, self.k_block, self.v_block, self.k_cache, self.v_cache, self.cache_offsets,
                self.cache_lens, self.scale, self.window)

    def kwargs(self) -> Dict[str, object]:
        return dict(self.__dict__)


def make_attention_inputs(lens: Sequence[int], Bq: int, Hq: int, Hkv: int, D: int, *, window: int = 0,
                          dtype=torch.float32, device="cpu", seed: int = 0, gap: int = 3,
                          poison: bool = True, q_std: float = 1.5) -> AttentionInputs:
    """Sequences laid out one after another in the cache with `gap` rows between them.
    With poison=True every cache row outside the rows the op may read (each sequence's
    context, after the window) is NaN, so any out-of-range read shows up as NaN."""
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
            start = off + max(0, n - window) if window > 0 else off
            readable[start:off + n] = True
        k_cache[~readable.to(device)] = float("nan")
        v_cache[~readable.to(device)] = float("nan")
    return AttentionInputs(q, k_block, v_block, k_cache, v_cache,
                           torch.tensor(offsets, dtype=torch.long, device=device),
                           torch.tensor(list(lens), dtype=torch.long, device=device),
                           D ** -0.5, window)


def check_attention(inp: AttentionInputs, op: Callable = dflash_ext.block_attention) -> torch.Tensor:
    return check_op(op, reference.block_attention, *inp.args())
