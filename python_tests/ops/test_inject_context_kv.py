"""inject_context_kv (in place) against reference.inject_context_kv.

The caches start filled with a sentinel (NaN unless stated): rows whose slot is -1 or
that no token targets must keep it bit for bit, written rows must match the reference."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash_ext
from dflash_ext.testing.inputs import make_inject_inputs

from python_tests.helpers import DEVICES, DTYPES, HAS_CUDA, check_inject

# (T, H, N, Hkv, D): every value of T {1, 7, 16, 300}, H {64, 576, 1024}, N {1, 5},
# Hkv {3, 4, 8} (the KV heads of the (Hq, Hkv) grid) and D {64, 128} appears with each dtype.
SHAPES = [
    (1, 64, 1, 4, 64),
    (1, 1024, 5, 3, 128),
    (7, 576, 5, 4, 64),
    (7, 64, 1, 8, 128),
    (16, 1024, 1, 8, 64),
    (16, 576, 5, 3, 128),
    (300, 64, 5, 4, 128),
    (300, 576, 1, 3, 64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,N,Hkv,D", SHAPES)
def test_matches_reference(T, H, N, Hkv, D, dtype, device):
    check_inject(make_inject_inputs(T, H, N, Hkv, D, dtype=dtype, device=device, seed=T + H + N))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("H", [64, 576, 1024])
@pytest.mark.parametrize("T", [1, 7, 16, 300])
def test_full_grid_fp32(T, H, N, device):
    """fp32 over T x H x N; the head shapes cycle through (Hkv, D) in {3, 4, 8} x {64, 128}."""
    Hkv, D = [(3, 64), (4, 128), (8, 64), (3, 128), (4, 64), (8, 128)][(T + H // 64 + N) % 6]
    check_inject(make_inject_inputs(T, H, N, Hkv, D, dtype=torch.float32, device=device, seed=2))


@pytest.mark.parametrize("device", DEVICES)
def test_largest_fp32(device):
    check_inject(make_inject_inputs(300, 1024, 5, 8, 128, dtype=torch.float32, device=device, seed=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skip_frac", [0.0, 0.5, 1.0])
def test_skipped_slots(skip_frac, dtype, device):
    """slots = -1 rows are never written (1.0: all but the first token skipped)."""
    inp = make_inject_inputs(16, 64, 5, 4, 64, dtype=dtype, device=device, seed=3, skip_frac=skip_frac)
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_slots_skipped(dtype, device):
    inp = make_inject_inputs(7, 64, 2, 4, 64, dtype=dtype, device=device, seed=4)
    inp.slots = torch.full_like(inp.slots, -1)
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_T(dtype, device):
    check_inject(make_inject_inputs(0, 64, 2, 4, 64, dtype=dtype, device=device, S=5, P=5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_sentinel_and_hf_rope(dtype, device):
    """A finite sentinel (a NaN check alone could miss a stray write of NaN) and the usual
    HF rope tables; every cache row but the written ones must keep the exact value."""
    inp = make_inject_inputs(16, 576, 5, 8, 128, S=64, P=4096, dtype=dtype, device=device, seed=5,
                             sentinel=-7.25, random_angles=False)
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_positions_edges_and_repeats(dtype, device):
    """Positions 0 and P-1, repeated positions, slots in reverse order covering the whole cache."""
    inp = make_inject_inputs(8, 64, 2, 4, 64, S=8, P=11, dtype=dtype, device=device, seed=6)
    inp.positions = torch.tensor([0, 10, 10, 3, 0, 10, 5, 5], device=device)
    inp.slots = torch.arange(7, -1, -1, device=device)
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_inputs(dtype, device):
    """Strided ctx rows, transposed-back weights, strided cos/sin and index tensors."""
    inp = make_inject_inputs(7, 64, 2, 4, 64, dtype=dtype, device=device, seed=7)
    nc = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)
    wide = torch.cat([inp.ctx, inp.ctx[:, :5]], dim=1)
    inp.ctx = wide[:, :64]
    inp.k_weight, inp.v_weight, inp.k_norm_weight = nc(inp.k_weight), nc(inp.v_weight), nc(inp.k_norm_weight)
    inp.cos, inp.sin = nc(inp.cos), nc(inp.sin)
    inp.positions = torch.stack([inp.positions, inp.positions], 1)[:, 0]
    inp.slots = torch.stack([inp.slots, inp.slots], 1)[:, 1]
    for t in (inp.ctx, inp.k_weight, inp.cos, inp.positions, inp.slots):
        assert not t.is_contiguous()
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token_unusual_stride(dtype, device):
    """A [1, H] ctx whose row stride is 1 (a transposed column: PyTorch calls it contiguous)."""
    inp = make_inject_inputs(1, 64, 2, 4, 64, dtype=dtype, device=device, seed=8, skip_frac=0.0)
    inp.ctx = inp.ctx.reshape(-1, 1).t()
    assert inp.ctx.is_contiguous() and inp.ctx.stride() == (1, 1)
    check_inject(inp)


@pytest.mark.parametrize("device", DEVICES)
def test_caches_are_views_of_one_buffer(device):
    """k_cache and v_cache as the two halves of one contiguous kv buffer."""
    inp = make_inject_inputs(7, 64, 2, 4, 64, device=device, seed=9)
    kv = torch.full((2, *inp.k_cache.shape), float("nan"), device=device)
    inp.k_cache, inp.v_cache = kv[0], kv[1]
    check_inject(inp)


def test_repeated_calls_append():
    """Two calls with disjoint token ranges fill the cache like one call with all tokens."""
    split = make_inject_inputs(16, 64, 2, 4, 64, S=16, seed=10, skip_frac=0.0)
    for s in (slice(0, 9), slice(9, 16)):
        dflash_ext.inject_context_kv(*dataclasses.replace(
            split, ctx=split.ctx[s], positions=split.positions[s], slots=split.slots[s]).args())
    whole = make_inject_inputs(16, 64, 2, 4, 64, S=16, seed=10, skip_frac=0.0)
    check_inject(whole)
    torch.testing.assert_close(split.k_cache, whole.k_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(split.v_cache, whole.v_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,N,Hkv,D", [(1, 64, 1, 4, 64), (16, 576, 5, 3, 128), (300, 64, 1, 8, 64)])
def test_blas_fallback(T, H, N, Hkv, D, dtype, blas_fallback):
    check_inject(make_inject_inputs(T, H, N, Hkv, D, dtype=dtype, seed=11))


def test_blas_fallback_single_token_unusual_stride(blas_fallback):
    test_single_token_unusual_stride(torch.float32, "cpu")


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 40), H=st.integers(1, 96), N=st.integers(1, 4), Hkv=st.integers(1, 4),
       half_D=st.integers(1, 40), extra_S=st.integers(0, 10), P=st.integers(1, 64),
       skip=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_property_fp32(T, H, N, Hkv, half_D, extra_S, P, skip, seed):
    check_inject(make_inject_inputs(T, H, N, Hkv, 2 * half_D, S=T + extra_S, P=P, seed=seed,
                                    skip_frac=skip))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,N,Hkv,D", [
    pytest.param(1, 4096, 5, 8, 128, id="qwen3-decode"),
    pytest.param(16, 4096, 5, 8, 128, id="qwen3-block"),
    pytest.param(2048, 4096, 5, 8, 128, id="qwen3-prefill"),
    pytest.param(16, 576, 3, 3, 64, id="smollm2-block"),
    pytest.param(9, 100, 2, 2, 64, id="H-not-multiple-of-8"),
    pytest.param(9, 256, 2, 2, 96, id="D-96-simple-path"),
    pytest.param(17, 1024, 2, 2, 128, id="tensor-cores-split-k"),
    pytest.param(5, 64, 4, 2, 64, id="gemv-ctas-spanning-many-heads"),
])
@pytest.mark.parametrize("skip_frac", [0.0, 0.5])
def test_cuda_model_shapes_and_fallbacks(T, H, N, Hkv, D, dtype, skip_frac):
    """The GEMV at T <= 16, the tensor-core kernel above (split K when few row tiles), the
    SIMT path; skipped tokens (slot -1) on each."""
    check_inject(make_inject_inputs(T, H, N, Hkv, D, dtype=dtype, device="cuda", seed=T + N, skip_frac=skip_frac))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skip_frac", [0.0, 0.5])
@pytest.mark.parametrize("T,H,N,Hkv,D", SHAPES)
def test_every_cpu_isa_path(T, H, N, Hkv, D, skip_frac, dtype, cpu_isa_level):
    """Each dispatch path this CPU can take (forced lower levels included) meets the reference,
    with every slot written and with half of them skipped."""
    check_inject(make_inject_inputs(T, H, N, Hkv, D, dtype=dtype, seed=T + H + N + 1, skip_frac=skip_frac))
