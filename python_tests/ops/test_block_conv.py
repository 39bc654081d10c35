"""block_conv (DFlash2's block convolution) against reference.block_conv: shapes, dtypes,
strides, every CPU ISA level, the taps and blocks it must never read, opcheck and
torch.compile, bad inputs naming the argument, and the inference-only rule. On CUDA the op
is not fused yet (it runs the reference math in ATen ops); those cases skip without a GPU."""
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_gen, randn

from python_tests.helpers import DEVICES, DTYPES, assert_close, check_op

ops = torch.ops.dflash_ext


def make_conv_inputs(M, B, H, T, G, *, dtype=torch.float32, device="cpu", seed=0):
    """x [M, B, H], base [T, H], delta [M, B, T, G]: random normal values (never all zero),
    coefficients of the size a trained conv has around its identity tap."""
    gen = make_gen(seed)
    return (randn((M, B, H), gen, dtype, device), randn((T, H), gen, dtype, device, 0.5),
            randn((M, B, T, G), gen, dtype, device, 0.5))


def check_conv(x, base, delta):
    return check_op(dflash_ext.ops.block_conv, reference.block_conv, x, base, delta)


# (M, B, H, T, G): B 1..16, T 1..4 (T > B too), group sizes 1 (G = H), 3, 4, 16 (DFlash2's),
# 32 and H (G = 1), H a multiple of the kernel's 16-channel step or not.
SHAPES = [
    (1, 1, 16, 1, 1),
    (2, 1, 24, 3, 24),
    (3, 2, 40, 4, 8),
    (5, 4, 576, 2, 36),
    (2, 8, 100, 2, 25),
    (4, 16, 48, 3, 3),
    (1, 16, 33, 4, 11),
    (3, 5, 64, 4, 1),
    (2, 7, 17, 2, 17),
    (1, 3, 7, 2, 7),
    (2, 12, 160, 1, 5),
    (2, 6, 2048, 2, 128),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,B,H,T,G", SHAPES)
def test_matches_reference(M, B, H, T, G, dtype, device):
    check_conv(*make_conv_inputs(M, B, H, T, G, dtype=dtype, device=device, seed=M * B + H + T * G))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("B", range(1, 17))
def test_every_block_size_and_tap_count(B, T, device):
    check_conv(*make_conv_inputs(3, B, 40, T, 10, device=device, seed=16 * B + T))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,B,H,T,G", SHAPES[:8])
def test_every_cpu_isa_path(M, B, H, T, G, dtype, cpu_isa_level):
    """One kernel at every level (the op calls no library kernel the level would choose):
    forced levels give the reference's result too."""
    check_conv(*make_conv_inputs(M, B, H, T, G, dtype=dtype, seed=M + B + H + T + G))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,G", [(40, 10), (64, 4)], ids=["group4", "group16"])
def test_unread_taps_and_blocks_never_leak(H, G, dtype, device):
    """NaN wherever the op must not read: the taps past a slot's position (delta[m, i, t] for
    t > i) and past the block (base[t] for t >= B). Block 1 is all NaN: blocks 0 and 2 must
    not see it (the conv never crosses a block boundary)."""
    M, B, T = 3, 3, 5
    x, base, delta = make_conv_inputs(M, B, H, T, G, dtype=dtype, device=device, seed=11)
    base[B:] = float("nan")
    for i in range(B):
        delta[:, i, i + 1:] = float("nan")
    clean = check_conv(x, base, delta)  # the reference reads none of them either
    x[1] = float("nan")
    out = dflash_ext.ops.block_conv(x, base, delta)
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(out[2], clean[2], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(dtype, device):
    """Rows of a wider tensor, blocks and slots swapped in memory, channels at stride 2 (copied),
    delta and base non-contiguous: all read as the reference reads them."""
    M, B, H, T, G = 3, 6, 48, 3, 3
    x, base, delta = make_conv_inputs(M, B, H, T, G, dtype=dtype, device=device, seed=12)
    wide = torch.cat([x, x[..., :7]], -1)[..., :H]
    swapped = x.transpose(0, 1).contiguous().transpose(0, 1)
    channel_strided = torch.stack([x, x], -1).flatten(-2)[..., ::2]
    assert wide.stride(1) == H + 7 and swapped.stride(0) == H and channel_strided.stride(2) == 2
    delta_nc = delta.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    base_nc = base.t().contiguous().t()
    assert not delta_nc.is_contiguous() and not base_nc.is_contiguous()
    expected = check_conv(x, base, delta)
    for xi in (wide, swapped, channel_strided):
        got = check_conv(xi, base_nc, delta_nc)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,B,H", [(0, 4, 32), (2, 0, 32), (2, 4, 0)])
def test_empty(M, B, H, device):
    x, base, delta = make_conv_inputs(M, B, H, 2, 1 if H == 0 else 4, device=device)
    out = dflash_ext.ops.block_conv(x, base, delta)
    assert out.shape == (M, B, H) and out.dtype == x.dtype


def test_no_taps_gives_zeros():
    x, base, delta = make_conv_inputs(2, 3, 32, 0, 4)
    torch.testing.assert_close(dflash_ext.ops.block_conv(x, base, delta), torch.zeros_like(x), rtol=0, atol=0)


def test_output_is_fresh_deterministic_and_inputs_untouched():
    args = make_conv_inputs(3, 8, 576, 2, 36, seed=13)
    before = [t.clone() for t in args]
    out1, out2 = dflash_ext.ops.block_conv(*args), dflash_ext.ops.block_conv(*args)
    assert out1.is_contiguous() and out1.data_ptr() != out2.data_ptr()
    assert torch.equal(out1, out2), "not deterministic"
    for a, b in zip(before, args):
        assert torch.equal(a, b)


def test_many_threads_match_one(many_threads):
    args = make_conv_inputs(5, 16, 576, 2, 36, seed=14)
    threaded = dflash_ext.ops.block_conv(*args)
    torch.set_num_threads(1)
    torch.testing.assert_close(threaded, dflash_ext.ops.block_conv(*args), rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(M=st.integers(0, 5), B=st.integers(1, 16), T=st.integers(0, 5), group=st.sampled_from([1, 2, 3, 8, 16, 48]),
       G=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_property_fp32(M, B, T, group, G, seed):
    x, base, delta = make_conv_inputs(M, B, group * G, T, G, seed=seed)
    assert_close(dflash_ext.ops.block_conv(x, base, delta), reference.block_conv(x, base, delta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unfused_kernel_on_the_cpu(dtype):
    """The ATen-ops kernel CUDA runs (not fused there yet), reached on the CPU by dispatching
    to CompositeExplicitAutograd past the fused CPU kernel."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    for M, B, H, T, G in SHAPES[:6]:
        args = make_conv_inputs(M, B, H, T, G, dtype=dtype, seed=M + H)
        check_op(lambda *a: ops.block_conv.default.redispatch(keys, *a), reference.block_conv, *args)


# ---- torch.library and torch.compile ------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 4, 48, 2, 3), (1, 3, 17, 4, 17)], ids=["group16", "T_above_B"])
def test_opcheck(shape):
    torch.library.opcheck(ops.block_conv.default, make_conv_inputs(*shape, seed=15))


def test_compile():
    args = make_conv_inputs(2, 4, 48, 2, 3, seed=16)
    fn = torch.compile(lambda x, base, delta: dflash_ext.ops.block_conv(x, base, delta) * 2, fullgraph=True)
    torch.testing.assert_close(fn(*args), dflash_ext.ops.block_conv(*args) * 2, rtol=0, atol=0)


# ---- bad inputs --------------------------------------------------------------------------
M_, B_, H_, T_, G_ = 2, 4, 16, 2, 4


def replace(name, fn):
    def mutate(a):
        a[name] = fn(a[name])
    return mutate


BAD = [
    ("x_float64", replace("x", lambda t: t.double()), r"\bx must be float32"),
    ("x_int32", replace("x", lambda t: t.int()), r"\bx must be float32"),
    ("x_2d", replace("x", lambda t: t[0]), r"\bx must be a 3-D tensor"),
    ("x_4d", replace("x", lambda t: t[None]), r"\bx must be a 3-D tensor"),
    ("base_bf16", replace("base", lambda t: t.bfloat16()), r"base has dtype BFloat16 but x has dtype Float"),
    ("delta_fp16", replace("delta", lambda t: t.half()), r"delta has dtype Half but x has dtype Float"),
    ("delta_int64", replace("delta", lambda t: t.long()), r"delta has dtype Long"),
    ("all_float64", lambda a: a.update({k: v.double() for k, v in a.items()}), r"\bx must be float32"),
    ("base_1d", replace("base", lambda t: t[0]), r"base must have 2 dimensions"),
    ("base_width", replace("base", lambda t: torch.randn(T_, H_ + 1)), r"base must have shape \[T, H\] with H=16"),
    ("delta_3d", replace("delta", lambda t: t[0]), r"delta must have 4 dimensions"),
    ("delta_blocks", replace("delta", lambda t: torch.randn(M_ + 1, B_, T_, G_)), r"delta must have shape \[M, B, T, G\]"),
    ("delta_slots", replace("delta", lambda t: torch.randn(M_, B_ - 1, T_, G_)), r"delta must have shape \[M, B, T, G\]"),
    ("delta_taps", replace("delta", lambda t: torch.randn(M_, B_, T_ + 1, G_)), r"delta must have shape \[M, B, T, G\]"),
    ("groups_not_dividing_H", replace("delta", lambda t: torch.randn(M_, B_, T_, 5)), r"delta's channel groups G=5 .*divide H=16"),
    ("no_groups", replace("delta", lambda t: torch.randn(M_, B_, T_, 0)), r"delta's channel groups G=0"),
    ("base_on_meta", replace("base", lambda t: t.to("meta")), r"base is on meta but x is on cpu"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in BAD])
def test_bad_input_names_the_argument(mutate, match, device):
    x, base, delta = make_conv_inputs(M_, B_, H_, T_, G_, seed=17)
    kwargs = dict(x=x, base=base, delta=delta)
    mutate(kwargs)
    kwargs = {k: v if v.device.type == "meta" else v.to(device) for k, v in kwargs.items()}
    if device == "cuda" and match.endswith("x is on cpu"):
        match = match.replace("cpu", "cuda:0")
    with pytest.raises(RuntimeError, match=match):
        dflash_ext.ops.block_conv(**kwargs)


def test_base_inputs_are_valid():
    dflash_ext.ops.block_conv(*make_conv_inputs(M_, B_, H_, T_, G_, seed=17))


# ---- inference only ----------------------------------------------------------------------
@pytest.mark.parametrize("grad_arg", [0, 1, 2], ids=["x", "base", "delta"])
def test_asked_for_a_gradient_raises(grad_arg):
    args = make_conv_inputs(M_, B_, H_, T_, G_, seed=18)
    args[grad_arg].requires_grad_(True)
    message = ("dflash_ext.ops.block_conv has no backward (inference only): call it under torch.no_grad() / "
               "torch.inference_mode(), or use dflash_ext.ops.reference.block_conv for gradients")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        dflash_ext.ops.block_conv(*args)
    with torch.no_grad():
        check_conv(*args)
    with torch.inference_mode():
        dflash_ext.ops.block_conv(*args)


# ---- the benchmark's eager baseline ------------------------------------------------------
@pytest.mark.parametrize("M,B,H,T,G", [(2, 4, 48, 2, 3), (1, 3, 17, 4, 17), (3, 16, 64, 3, 1)])
def test_bench_eager_baseline_matches_reference(M, B, H, T, G):
    """bench_ops times block_conv against eager_block_conv (pad + unfold): the same op."""
    from bench.baselines import eager_block_conv
    from bench.bench_ops import PRESETS, min_bytes
    args = make_conv_inputs(M, B, H, T, G, seed=19)
    assert_close(eager_block_conv(*args), reference.block_conv(*args))
    assert min_bytes("block_conv", PRESETS["smollm2"], 2, B, batch=M, conv_shape=(M, B, H, T, G)) == (
        2 * M * B * H + T * H + M * B * T * G) * 2
