"""project_features against reference.project_features."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_project_inputs

from python_tests.helpers import DEVICES, DTYPES, HAS_CUDA, assert_close, check_op


def check_project(feats, fc_weight, norm_weight, eps):
    return check_op(dflash_ext.project_features, reference.project_features, feats, fc_weight,
                    norm_weight, eps)


# (T, H, k, H_out): every value of T {1, 7, 16, 300}, H {64, 576, 1024}, k {1, 3, 5} appears
# with each dtype; H_out = H (the drafter's fc) except where given.
SHAPES = [
    (1, 64, 1, None),
    (1, 1024, 3, None),
    (7, 576, 3, None),
    (7, 1024, 1, 200),
    (16, 64, 3, None),
    (16, 1024, 5, None),
    (300, 64, 5, None),
    (300, 576, 1, 128),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,H_out", SHAPES)
def test_matches_reference(T, H, k, H_out, dtype, device):
    check_project(*make_project_inputs(T, H, k, H_out, dtype=dtype, device=device, seed=T * H + k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("H", [64, 576, 1024])
@pytest.mark.parametrize("T", [1, 7, 16, 300])
def test_full_grid_fp32(T, H, k, device):
    check_project(*make_project_inputs(T, H, k, dtype=torch.float32, device=device, seed=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["hidden_states", "wide", "colstrided"])
@pytest.mark.parametrize("T,H,k", [(7, 64, 3), (16, 576, 5), (1, 64, 3)])
def test_strided_features(T, H, k, layout, dtype, device):
    feats, w, nw, eps = make_project_inputs(T, H, k, dtype=dtype, device=device, seed=3, layout=layout)
    if layout != "colstrided":
        assert all(f.stride(1) == 1 and not f.is_contiguous() for f in feats if T > 1)
    check_project(feats, w, nw, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_weights(dtype, device):
    """Transposed-then-transposed-back fc_weight and a strided norm_weight."""
    feats, w, nw, eps = make_project_inputs(7, 64, 3, 96, dtype=dtype, device=device, seed=4)
    w_nc = w.t().contiguous().t()
    nw_nc = torch.stack([nw, nw], dim=1)[:, 0]
    assert not w_nc.is_contiguous() and not nw_nc.is_contiguous()
    check_project(feats, w_nc, nw_nc, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unusual_row_strides(dtype, device):
    """Valid [T, H] views whose row stride is smaller than H: a single row that PyTorch
    calls contiguous although its row stride is 1 (a transposed column), rows broadcast
    with stride 0 (expand), and overlapping sliding windows (unfold)."""
    _, w, nw, eps = make_project_inputs(5, 64, 3, dtype=dtype, device=device, seed=5)
    g = torch.Generator().manual_seed(6)
    col = torch.randn(64, 1, generator=g).to(dtype=dtype, device=device).t()    # [1, 64], strides (1, 1)
    row = torch.randn(64, generator=g).to(dtype=dtype, device=device)
    windows = torch.randn(5 + 63, generator=g).to(dtype=dtype, device=device).unfold(0, 64, 1)
    full = torch.randn(5, 64, generator=g).to(dtype=dtype, device=device)
    assert col.is_contiguous() and col.stride() == (1, 1)
    check_project([col, row[None], row.expand(1, 64)], w, nw, eps)
    check_project([row.expand(5, 64), windows, full], w, nw, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_T(dtype, device):
    feats, w, nw, eps = make_project_inputs(0, 64, 3, 32, dtype=dtype, device=device)
    out = dflash_ext.project_features(feats, w, nw, eps)
    assert out.shape == (0, 32) and out.dtype == dtype and out.device.type == device


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.5])
def test_eps(eps):
    feats, w, nw, _ = make_project_inputs(7, 64, 3, dtype=torch.float32, seed=7)
    feats = [f * 1e-3 for f in feats]  # small activations: eps matters
    check_project(feats, w, nw, eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,H_out", [(1, 64, 1, None), (16, 576, 3, None), (300, 64, 5, 200)])
def test_blas_fallback(T, H, k, H_out, dtype, blas_fallback):
    check_project(*make_project_inputs(T, H, k, H_out, dtype=dtype, seed=8))


def test_blas_fallback_unusual_row_strides(blas_fallback):
    test_unusual_row_strides(torch.float32, "cpu")


def test_output_is_fresh_and_inputs_untouched():
    feats, w, nw, eps = make_project_inputs(7, 64, 3, dtype=torch.float32, seed=9)
    before = [t.clone() for t in (*feats, w, nw)]
    out1 = dflash_ext.project_features(feats, w, nw, eps)
    out2 = dflash_ext.project_features(feats, w, nw, eps)
    assert out1.is_contiguous() and out1.data_ptr() != out2.data_ptr()
    assert torch.equal(out1, out2), "not deterministic"
    for a, b in zip(before, (*feats, w, nw)):
        assert torch.equal(a, b)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 40), H=st.integers(1, 160), k=st.integers(1, 6), H_out=st.integers(4, 160),
       layout=st.sampled_from(["contiguous", "hidden_states", "wide", "colstrided"]),
       seed=st.integers(0, 2**31 - 1))
def test_property_fp32(T, H, k, H_out, layout, seed):
    feats, w, nw, eps = make_project_inputs(T, H, k, H_out, seed=seed, layout=layout)
    out = dflash_ext.project_features(feats, w, nw, eps)
    assert_close(out, reference.project_features(feats, w, nw, eps))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,H_out", [
    pytest.param(1, 4096, 5, 4096, id="qwen3-decode"),
    pytest.param(16, 4096, 5, 4096, id="qwen3-block"),
    pytest.param(2000, 4096, 5, 4096, id="qwen3-prefill"),
    pytest.param(9000, 576, 3, 576, id="long-prefill"),
    pytest.param(17, 576, 3, 576, id="first-cublas-row-count"),
    pytest.param(16, 576, 20, 576, id="more-features-than-kernel-slots"),
    pytest.param(5, 100, 3, 72, id="H-not-multiple-of-8"),
    pytest.param(2, 64, 1, 4096, id="gemv-ctas-spanning-many-row-blocks"),
    pytest.param(9, 64, 2, 90, id="gemv-partial-row-block"),
    pytest.param(8, 1024, 3, 1024, id="gemv-one-token-tile-full"),
])
def test_cuda_model_shapes_and_fallbacks(T, H, k, H_out, dtype):
    """Drafter shapes (the GEMV at T <= 16, cuBLAS above) and the shapes that take the
    cuBLAS path in bf16/fp16 at any T (odd H)."""
    check_project(*make_project_inputs(T, H, k, H_out, dtype=dtype, device="cuda", seed=T + k))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_misaligned_feature_views(dtype):
    """A feature view that starts 1 element into its buffer cannot use 16-byte loads."""
    feats, w, nw, eps = make_project_inputs(16, 576, 3, dtype=dtype, device="cuda", seed=5)
    shifted = []
    for f in feats:
        buf = torch.empty(f.numel() + 1, dtype=dtype, device="cuda")
        view = buf[1:].view(f.shape)
        view.copy_(f)
        shifted.append(view)
    check_project(shifted, w, nw, eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,H_out", SHAPES)
def test_every_cpu_isa_path(T, H, k, H_out, dtype, cpu_isa_level):
    """Each dispatch path this CPU can take (forced lower levels included) meets the reference."""
    check_project(*make_project_inputs(T, H, k, H_out, dtype=dtype, seed=T * H + k + 1))
