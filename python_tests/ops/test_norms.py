"""The draft layer's norms (ops.rms_norm with and without a residual, ops.qk_norm_rope)
against their references on random inputs: shapes, dtypes, strided inputs, opcheck and
torch.compile, bad inputs naming the argument, and the inference-only rule. CUDA cases skip
without a GPU (the CUDA kernels are compiled and SASS-checked but have not run on one)."""
import re

import pytest
import torch

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_gen, norm_weight, randn

from python_tests.helpers import DEVICES, DTYPES, assert_close

ops = torch.ops.dflash_ext


def make_norm_inputs(shape, *, dtype=torch.float32, device="cpu", seed=0):
    """x, residual (random normal, never zero; residual of the size a sublayer adds) and a
    norm weight around 1."""
    gen = make_gen(seed)
    return (randn(shape, gen, dtype, device), randn(shape, gen, dtype, device, 0.5),
            norm_weight(shape[-1:], gen, dtype, device))


def make_qkv_inputs(M, Hq, Hkv, D, *, dtype=torch.float32, device="cpu", seed=0, extra_columns=0):
    """qkv [M, (Hq + 2 Hkv) * D] (a row-strided view when extra_columns > 0), q/k norm
    weights [D] and cos/sin [M, D] rows of a real RoPE table at random positions."""
    gen = make_gen(seed)
    width = (Hq + 2 * Hkv) * D
    qkv = randn((M, width + extra_columns), gen, dtype, device)[:, :width]
    positions = torch.randint(0, 4096, (M,), generator=gen)
    freqs = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    angles = positions[:, None].float() * torch.cat([freqs, freqs])[None]
    return (qkv, norm_weight((D,), gen, dtype, device), norm_weight((D,), gen, dtype, device),
            angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device))


def check_rms_norm(x, residual, weight, eps=1e-6):
    """The op against reference.rms_norm in fp32 (and in x's dtype for the tolerance rule);
    returns the op's outputs."""
    if residual is None:
        out = dflash_ext.ops.rms_norm(x, weight, eps)
        lowp = None if x.dtype == torch.float32 else reference.rms_norm(x, weight, eps)
        assert_close(out, reference.rms_norm(x, weight, eps, compute_dtype=torch.float32), lowp)
        return (out,)
    s, out = dflash_ext.ops.rms_norm(x, weight, eps, residual=residual)
    s32, ref32 = reference.rms_norm(x, weight, eps, residual=residual, compute_dtype=torch.float32)
    # the sum is one rounding of x + residual: exact against the reference
    torch.testing.assert_close(s, s32, rtol=0, atol=0)
    lowp = None if x.dtype == torch.float32 else reference.rms_norm(x, weight, eps, residual=residual)[1]
    assert_close(out, ref32, lowp)
    return s, out


def check_qk(qkv, qw, kw, cos, sin, Hq, Hkv, eps=1e-6):
    q, k = dflash_ext.ops.qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, eps)
    q32, k32 = reference.qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, eps)
    lowp = (None, None) if qkv.dtype == torch.float32 else \
        reference.qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, eps, compute_dtype=qkv.dtype)
    assert_close(q, q32, lowp[0], "q")
    assert_close(k, k32, lowp[1], "k")
    return q, k


NORM_SHAPES = [(1, 8), (3, 64), (2, 5, 576), (16, 1000), (1, 16, 4096), (7, 33)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_rms_norm_matches_reference(shape, with_residual, dtype, device):
    x, residual, weight = make_norm_inputs(shape, dtype=dtype, device=device, seed=sum(shape))
    check_rms_norm(x, residual if with_residual else None, weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_inputs(dtype, device):
    """A row-strided view and a transposed-in-memory residual read as the reference reads them."""
    x, residual, weight = make_norm_inputs((6, 96), dtype=dtype, device=device, seed=3)
    wide = torch.cat([x, x[:, :5]], 1)[:, :96]
    res_nc = residual.t().contiguous().t()
    assert not wide.is_contiguous() and not res_nc.is_contiguous()
    s, out = check_rms_norm(wide, res_nc, weight)
    s0, out0 = check_rms_norm(x, residual, weight)
    assert torch.equal(s, s0) and torch.equal(out, out0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,Hq,Hkv,D", [(1, 1, 1, 2), (16, 4, 2, 64), (3, 8, 8, 128), (5, 6, 2, 96), (2, 2, 1, 256),
                                        (32, 32, 8, 128), (4, 3, 1, 10)])
def test_qk_norm_rope_matches_reference(M, Hq, Hkv, D, dtype, device):
    check_qk(*make_qkv_inputs(M, Hq, Hkv, D, dtype=dtype, device=device, seed=M + Hq + D), Hq, Hkv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_reads_rows_at_their_stride(dtype, device):
    """qkv as the first columns of a wider tensor (a view), cos/sin transposed in memory."""
    args = make_qkv_inputs(6, 4, 2, 32, dtype=dtype, device=device, seed=4, extra_columns=9)
    qkv, qw, kw, cos, sin = args
    assert not qkv.is_contiguous()
    q, k = check_qk(qkv, qw, kw, cos.t().contiguous().t(), sin.t().contiguous().t(), 4, 2)
    q0, k0 = check_qk(qkv.contiguous(), qw, kw, cos, sin, 4, 2)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def at_offset(t, offset):
    """A contiguous copy of `t` that starts `offset` elements into its storage (for offset > 0
    not 16-byte aligned: the CUDA kernels take their element-wise path for it)."""
    view = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)[offset:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.storage_offset() == offset
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shifted", ["x", "residual", "weight", "all"])
def test_rms_norm_views_at_a_storage_offset(shifted, dtype, device):
    """Any one operand off the 16-byte grid (the rest aligned, H a whole number of vectors)
    reads and writes as the aligned operands do."""
    x, residual, weight = make_norm_inputs((5, 64), dtype=dtype, device=device, seed=15)
    args = {"x": x, "residual": residual, "weight": weight}
    args = {k: at_offset(v, 1) if shifted in (k, "all") else v for k, v in args.items()}
    s, _ = check_rms_norm(args["x"], args["residual"], args["weight"])
    assert torch.equal(s, check_rms_norm(x, residual, weight)[0])  # one rounding of x + residual either way
    check_rms_norm(args["x"], None, args["weight"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shifted", ["qkv", "q_norm_weight", "cos", "all"])
def test_qk_norm_rope_views_at_a_storage_offset(shifted, dtype, device):
    """qkv, a norm weight or cos off the 16-byte grid (D = 64: whole vectors otherwise)."""
    qkv, qw, kw, cos, sin = make_qkv_inputs(4, 4, 2, 64, dtype=dtype, device=device, seed=16)
    args = {"qkv": qkv, "q_norm_weight": qw, "k_norm_weight": kw, "cos": cos, "sin": sin}
    args = {k: at_offset(v, 1) if shifted in (k, "all") else v for k, v in args.items()}
    check_qk(*args.values(), 4, 2)


def test_qk_norm_rope_is_the_decoder_layers_math():
    """The op equals what DecoderLayer.forward does to q and k: q_norm / k_norm modules, then
    reference.apply_rope with cos/sin broadcast over the heads (fp32)."""
    from dflash_ext.model.layers import RMSNorm

    M, Hq, Hkv, D = 5, 4, 2, 16
    qkv, qw, kw, cos, sin = make_qkv_inputs(M, Hq, Hkv, D, seed=5)
    q_norm, k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        q_ref = reference.apply_rope(q_norm(qkv[:, :Hq * D].view(M, Hq, D)), cos[:, None], sin[:, None])
        k_ref = reference.apply_rope(k_norm(qkv[:, Hq * D:(Hq + Hkv) * D].view(M, Hkv, D)), cos[:, None], sin[:, None])
        q, k = dflash_ext.ops.qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x, residual, weight = make_norm_inputs((0, 32), device=device)
    assert dflash_ext.ops.rms_norm(x, weight).shape == (0, 32)
    s, out = dflash_ext.ops.rms_norm(x, weight, residual=residual)
    assert s.shape == out.shape == (0, 32)
    q, k = dflash_ext.ops.qk_norm_rope(*make_qkv_inputs(0, 4, 2, 8, device=device), 4, 2)
    assert q.shape == (0, 4, 8) and k.shape == (0, 2, 8)


def test_outputs_fresh_deterministic_and_inputs_untouched():
    x, residual, weight = make_norm_inputs((4, 128), seed=6)
    qkv_args = make_qkv_inputs(4, 4, 2, 32, seed=6)
    before = [t.clone() for t in (x, residual, weight, *qkv_args)]
    s1, o1 = dflash_ext.ops.rms_norm(x, weight, residual=residual)
    s2, o2 = dflash_ext.ops.rms_norm(x, weight, residual=residual)
    q1, k1 = dflash_ext.ops.qk_norm_rope(*qkv_args, 4, 2)
    q2, k2 = dflash_ext.ops.qk_norm_rope(*qkv_args, 4, 2)
    assert len({t.data_ptr() for t in (s1, o1, s2, o2, q1, k1, q2, k2)}) == 8
    assert all(torch.equal(a, b) for a, b in ((s1, s2), (o1, o2), (q1, q2), (k1, k2))), "not deterministic"
    assert all(torch.equal(a, b) for a, b in zip(before, (x, residual, weight, *qkv_args)))


def test_many_threads_match_one(many_threads):
    x, residual, weight = make_norm_inputs((64, 576), seed=7)
    qkv_args = make_qkv_inputs(64, 8, 2, 64, seed=7)
    threaded = (*dflash_ext.ops.rms_norm(x, weight, residual=residual), *dflash_ext.ops.qk_norm_rope(*qkv_args, 8, 2))
    torch.set_num_threads(1)
    single = (*dflash_ext.ops.rms_norm(x, weight, residual=residual), *dflash_ext.ops.qk_norm_rope(*qkv_args, 8, 2))
    for a, b in zip(threaded, single):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- torch.library and torch.compile ------------------------------------------------------
@pytest.mark.parametrize("name,make_args", [
    ("rms_norm", lambda: (make_norm_inputs((3, 5, 48), seed=8)[0], make_norm_inputs((3, 5, 48), seed=8)[2], 1e-6)),
    ("add_rms_norm", lambda: (*make_norm_inputs((6, 48), seed=9), 1e-5)),
    ("qk_norm_rope", lambda: (*make_qkv_inputs(5, 4, 2, 16, seed=10, extra_columns=3), 4, 2, 1e-6)),
])
def test_opcheck(name, make_args):
    torch.library.opcheck(getattr(ops, name).default, make_args())


def test_compile():
    x, residual, weight = make_norm_inputs((4, 64), seed=11)
    qkv_args = make_qkv_inputs(4, 4, 2, 16, seed=11)

    def fn(x, residual, weight, *qkv_args):
        s, h = dflash_ext.ops.rms_norm(x, weight, residual=residual)
        q, k = dflash_ext.ops.qk_norm_rope(*qkv_args, 4, 2)
        return dflash_ext.ops.rms_norm(s + h, weight) * 2, q * 2, k

    compiled = torch.compile(fn, fullgraph=True)
    for a, b in zip(compiled(x, residual, weight, *qkv_args), fn(x, residual, weight, *qkv_args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- bad inputs --------------------------------------------------------------------------
def replace(name, fn):
    def mutate(a):
        a[name] = fn(a[name])
    return mutate


NORM_BAD = [
    ("x_float64", replace("x", lambda t: t.double()), r"\bx must be float32"),
    ("x_int32", replace("x", lambda t: t.int()), r"\bx must be float32"),
    ("x_scalar", replace("x", lambda t: t[0, 0]), r"\bx must be a tensor \[\.\.\., H\] of at least 1 dimension"),
    ("weight_bf16", replace("weight", lambda t: t.bfloat16()), r"weight has dtype BFloat16 but x has dtype Float"),
    ("weight_width", replace("weight", lambda t: torch.ones(17)), r"weight must have shape \[16\]"),
    ("weight_2d", replace("weight", lambda t: t[None]), r"weight must have 1 dimensions"),
    ("residual_shape", replace("residual", lambda t: t[:2]), r"residual must have shape \[3, 16\]"),
    ("residual_fp16", replace("residual", lambda t: t.half()), r"residual has dtype Half but x has dtype Float"),
    ("residual_on_meta", replace("residual", lambda t: t.to("meta")), r"residual is on meta but x is on cpu"),
    ("eps_negative", lambda a: a.update(eps=-1.0), r"eps must be finite and >= 0"),
    ("eps_nan", lambda a: a.update(eps=float("nan")), r"eps must be finite and >= 0"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in NORM_BAD])
def test_rms_norm_bad_input_names_the_argument(mutate, match, device):
    x, residual, weight = make_norm_inputs((3, 16), seed=12)
    kwargs = dict(x=x, weight=weight, eps=1e-6, residual=residual)
    mutate(kwargs)
    kwargs = {k: v if not isinstance(v, torch.Tensor) or v.device.type == "meta" else v.to(device)
              for k, v in kwargs.items()}
    match = match.replace("x is on cpu", "x is on cuda:0") if device == "cuda" else match
    with pytest.raises(RuntimeError, match=match):
        dflash_ext.ops.rms_norm(**kwargs)


QK_BAD = [
    ("qkv_float64", replace("qkv", lambda t: t.double()), r"qkv must be float32"),
    ("qkv_3d", replace("qkv", lambda t: t[None]), r"qkv must be a 2-D tensor"),
    ("qkv_width", replace("qkv", lambda t: t[:, :-8]), r"qkv must have shape \[M, \(Hq \+ 2\*Hkv\) \* D\] = \[M, 64\]"),
    ("q_heads_zero", lambda a: a.update(num_q_heads=0), r"num_q_heads must be >= 1"),
    ("kv_heads_negative", lambda a: a.update(num_kv_heads=-1), r"num_kv_heads must be >= 1"),
    ("q_norm_odd", replace("q_norm_weight", lambda t: t[:7]), r"q_norm_weight must have shape \[D\] with D even"),
    ("q_norm_bf16", replace("q_norm_weight", lambda t: t.bfloat16()), r"q_norm_weight has dtype BFloat16"),
    ("k_norm_size", replace("k_norm_weight", lambda t: t[:4]), r"k_norm_weight must have shape \[8\]"),
    ("cos_rows", replace("cos", lambda t: t[:2]), r"cos must have shape \[3, 8\]"),
    ("sin_fp16", replace("sin", lambda t: t.half()), r"sin has dtype Half but qkv has dtype Float"),
    ("sin_on_meta", replace("sin", lambda t: t.to("meta")), r"sin is on meta but qkv is on cpu"),
    ("eps_inf", lambda a: a.update(eps=float("inf")), r"eps must be finite and >= 0"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in QK_BAD])
def test_qk_norm_rope_bad_input_names_the_argument(mutate, match, device):
    qkv, qw, kw, cos, sin = make_qkv_inputs(3, 4, 2, 8, seed=13)
    kwargs = dict(qkv=qkv, q_norm_weight=qw, k_norm_weight=kw, cos=cos, sin=sin, num_q_heads=4, num_kv_heads=2,
                  eps=1e-6)
    mutate(kwargs)
    kwargs = {k: v if not isinstance(v, torch.Tensor) or v.device.type == "meta" else v.to(device)
              for k, v in kwargs.items()}
    match = match.replace("qkv is on cpu", "qkv is on cuda:0") if device == "cuda" else match
    with pytest.raises(RuntimeError, match=match):
        dflash_ext.ops.qk_norm_rope(**kwargs)


def test_base_inputs_are_valid():
    x, residual, weight = make_norm_inputs((3, 16), seed=12)
    dflash_ext.ops.rms_norm(x, weight, residual=residual)
    dflash_ext.ops.qk_norm_rope(*make_qkv_inputs(3, 4, 2, 8, seed=13), 4, 2)


# ---- inference only ----------------------------------------------------------------------
def test_asked_for_a_gradient_raises():
    x, residual, weight = make_norm_inputs((3, 16), seed=14)
    weight.requires_grad_(True)
    for name, call in (("rms_norm", lambda: dflash_ext.ops.rms_norm(x, weight, residual=residual)),
                       ("qk_norm_rope", lambda: dflash_ext.ops.qk_norm_rope(
                           *make_qkv_inputs(3, 4, 2, 8, seed=14)[:1], weight[:8], weight[:8],
                           *make_qkv_inputs(3, 4, 2, 8, seed=14)[3:], 4, 2))):
        message = (f"dflash_ext.ops.{name} has no backward (inference only): call it under torch.no_grad() / "
                   f"torch.inference_mode(), or use dflash_ext.ops.reference.{name} for gradients")
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()
