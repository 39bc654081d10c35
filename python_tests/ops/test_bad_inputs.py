"""Invalid inputs raise a RuntimeError that names the offending argument, before any
cache row is written; non-contiguous inputs the ops accept are covered in the op files."""
import pytest
import torch

import dflash_ext
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs, make_project_inputs

from python_tests.helpers import DEVICES, HAS_CUDA, same_or_both_nan

OPS = {
    "project_features": dflash_ext.project_features,
    "inject_context_kv": dflash_ext.inject_context_kv,
    "block_attention": dflash_ext.block_attention,
    "skinny_linear": dflash_ext.skinny_linear,
}

# Small valid inputs: project T=5, H=16, k=2, H_out=8; inject T=5, H=16, N=2, Hkv=2, D=8,
# S=8, P=10; attention Bsz=2 (lens 3, 0 at offsets 3, 9), Bq=2, Hq=4, Hkv=2, D=8, S=12.
T, H, N, HKV, D, S, P = 5, 16, 2, 2, 8, 8, 10
ATT_S = 12


def base_kwargs(op):
    if op == "project_features":
        feats, w, nw, eps = make_project_inputs(T, H, 2, 8, seed=1)
        return dict(features=feats, fc_weight=w, norm_weight=nw, eps=eps)
    if op == "inject_context_kv":
        return make_inject_inputs(T, H, N, HKV, D, S=S, P=P, seed=1, skip_frac=0.0).kwargs()
    if op == "skinny_linear":
        return dict(x=randn(3, H), weight=randn(8, H), bias=randn(8))
    return make_attention_inputs([3, 0], 2, 4, HKV, D, seed=1, poison=False).kwargs()


def noncontig(t):
    """Same shape and values, last two dims stored transposed."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def setitem(key, fn):
    return lambda a: a.__setitem__(key, fn(a[key]))


def feature(j, fn):
    def mutate(a):
        a["features"] = list(a["features"])
        a["features"][j] = fn(a["features"][j])
    return mutate


def index_value(key, i, value):
    def mutate(a):
        a[key] = a[key].clone()
        a[key][i] = value
    return mutate


def to_device(kwargs, device):
    """kwargs with every tensor moved to `device` (one tensor passed twice stays one tensor)."""
    moved = {}

    def move(v):
        if isinstance(v, list):
            return [move(t) for t in v]
        if not isinstance(v, torch.Tensor):
            return v
        return moved.setdefault(id(v), v.to(device))
    return {k: move(v) for k, v in kwargs.items()}


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# (op, id, mutation of the valid kwargs, regex the message must contain)
BAD = [
    # --- project_features -------------------------------------------------------------
    ("project_features", "features_float64", feature(0, lambda f: f.double()), r"features\[0\]"),
    ("project_features", "features_int32", feature(0, lambda f: f.int()), r"features\[0\]"),
    ("project_features", "all_float64", lambda a: a.update(
        features=[f.double() for f in a["features"]], fc_weight=a["fc_weight"].double(),
        norm_weight=a["norm_weight"].double()), r"features\[0\]"),
    ("project_features", "features1_fp16", feature(1, lambda f: f.half()), r"features\[1\]"),
    ("project_features", "fc_weight_bf16", setitem("fc_weight", lambda w: w.bfloat16()), "fc_weight"),
    ("project_features", "norm_weight_float64", setitem("norm_weight", lambda w: w.double()), "norm_weight"),
    ("project_features", "features1_width", feature(1, lambda f: randn(T, H + 1)), r"features\[1\]"),
    ("project_features", "features1_rows", feature(1, lambda f: randn(T - 1, H)), r"features\[1\]"),
    ("project_features", "features_3d", feature(0, lambda f: f[None]), r"features\[0\]"),
    ("project_features", "features_1d", feature(0, lambda f: f[0]), r"features\[0\]"),
    ("project_features", "fc_weight_width", setitem("fc_weight", lambda w: randn(8, 2 * H + 1)), "fc_weight"),
    ("project_features", "fc_weight_1d", setitem("fc_weight", lambda w: w[0]), "fc_weight"),
    ("project_features", "norm_weight_len", setitem("norm_weight", lambda w: randn(9)), "norm_weight"),
    ("project_features", "norm_weight_2d", setitem("norm_weight", lambda w: w[None]), "norm_weight"),
    ("project_features", "no_features", lambda a: a.update(features=[]), "features"),
    ("project_features", "eps_negative", lambda a: a.update(eps=-1e-6), "eps"),
    ("project_features", "eps_nan", lambda a: a.update(eps=float("nan")), "eps"),
    # --- inject_context_kv ------------------------------------------------------------
    ("inject_context_kv", "ctx_float64", setitem("ctx", lambda t: t.double()), "ctx"),
    ("inject_context_kv", "ctx_int64", setitem("ctx", lambda t: t.long()), "ctx"),
    ("inject_context_kv", "k_weight_bf16", setitem("k_weight", lambda t: t.bfloat16()), "k_weight"),
    ("inject_context_kv", "v_weight_fp16", setitem("v_weight", lambda t: t.half()), "v_weight"),
    ("inject_context_kv", "k_norm_weight_float64", setitem("k_norm_weight", lambda t: t.double()), "k_norm_weight"),
    ("inject_context_kv", "cos_bf16", setitem("cos", lambda t: t.bfloat16()), "cos"),
    ("inject_context_kv", "sin_float64", setitem("sin", lambda t: t.double()), "sin"),
    ("inject_context_kv", "k_cache_fp16", setitem("k_cache", lambda t: t.half()), "k_cache"),
    ("inject_context_kv", "v_cache_bf16", setitem("v_cache", lambda t: t.bfloat16()), "v_cache"),
    ("inject_context_kv", "ctx_1d", setitem("ctx", lambda t: t[0]), "ctx"),
    ("inject_context_kv", "k_cache_3d", setitem("k_cache", lambda t: t[0]), "k_cache"),
    ("inject_context_kv", "odd_head_dim", lambda a: a.update(k_cache=randn(N, S, HKV, 7), v_cache=randn(N, S, HKV, 7)), "k_cache"),
    ("inject_context_kv", "v_cache_rows", setitem("v_cache", lambda t: randn(N, S + 1, HKV, D)), "v_cache"),
    ("inject_context_kv", "k_weight_rows", setitem("k_weight", lambda t: randn(N, HKV * D + 2, H)), "k_weight"),
    ("inject_context_kv", "k_weight_width", setitem("k_weight", lambda t: randn(N, HKV * D, H + 1)), "k_weight"),
    ("inject_context_kv", "v_weight_layers", setitem("v_weight", lambda t: randn(N + 1, HKV * D, H)), "v_weight"),
    ("inject_context_kv", "k_norm_weight_shape", setitem("k_norm_weight", lambda t: randn(N, D + 2)), "k_norm_weight"),
    ("inject_context_kv", "cos_width", setitem("cos", lambda t: randn(P, D + 2)), "cos"),
    ("inject_context_kv", "sin_rows", setitem("sin", lambda t: randn(P + 1, D)), "sin"),
    ("inject_context_kv", "positions_int32", setitem("positions", lambda t: t.int()), "positions"),
    ("inject_context_kv", "positions_float", setitem("positions", lambda t: t.float()), "positions"),
    ("inject_context_kv", "slots_int32", setitem("slots", lambda t: t.int()), "slots"),
    ("inject_context_kv", "positions_len", setitem("positions", lambda t: torch.arange(T + 1)), "positions"),
    ("inject_context_kv", "slots_2d", setitem("slots", lambda t: t[None]), "slots"),
    ("inject_context_kv", "position_eq_P", index_value("positions", 3, P), r"positions\[3\]"),
    ("inject_context_kv", "position_negative", index_value("positions", 0, -1), r"positions\[0\]"),
    ("inject_context_kv", "slot_eq_S", index_value("slots", 2, S), r"slots\[2\]"),
    ("inject_context_kv", "slot_below_minus1", index_value("slots", 4, -2), r"slots\[4\]"),
    ("inject_context_kv", "duplicate_slots", lambda a: a.update(slots=torch.tensor([6, 1, -1, 1, 3])), "slots must not repeat"),
    ("inject_context_kv", "k_cache_noncontiguous", setitem("k_cache", noncontig), "k_cache must be contiguous"),
    ("inject_context_kv", "v_cache_noncontiguous", setitem("v_cache", lambda t: torch.full((N, S, HKV, 2 * D), 0.5)[..., ::2]), "v_cache must be contiguous"),
    ("inject_context_kv", "k_cache_is_v_cache", lambda a: a.update(v_cache=a["k_cache"]), "k_cache and v_cache"),
    ("inject_context_kv", "eps_negative", lambda a: a.update(eps=-1.0), "eps"),
    # --- block_attention --------------------------------------------------------------
    ("block_attention", "q_float64", setitem("q", lambda t: t.double()), r"\bq\b"),
    ("block_attention", "q_int32", setitem("q", lambda t: t.int()), r"\bq\b"),
    ("block_attention", "k_block_bf16", setitem("k_block", lambda t: t.bfloat16()), "k_block"),
    ("block_attention", "v_block_fp16", setitem("v_block", lambda t: t.half()), "v_block"),
    ("block_attention", "k_cache_float64", setitem("k_cache", lambda t: t.double()), "k_cache"),
    ("block_attention", "v_cache_bf16", setitem("v_cache", lambda t: t.bfloat16()), "v_cache"),
    ("block_attention", "q_3d", setitem("q", lambda t: t[0]), r"\bq\b"),
    ("block_attention", "k_block_Bq", setitem("k_block", lambda t: randn(2, 3, HKV, D)), "k_block"),
    ("block_attention", "k_block_D", setitem("k_block", lambda t: randn(2, 2, HKV, D + 1)), "k_block"),
    ("block_attention", "v_block_heads", setitem("v_block", lambda t: randn(2, 2, HKV + 1, D)), "v_block"),
    ("block_attention", "Hq_not_multiple_of_Hkv", setitem("q", lambda t: randn(2, 2, 5, D)), r"Hq=5.*Hkv=2.*k_block"),
    ("block_attention", "k_cache_heads", setitem("k_cache", lambda t: randn(ATT_S, HKV + 1, D)), "k_cache"),
    ("block_attention", "v_cache_rows", setitem("v_cache", lambda t: randn(ATT_S + 1, HKV, D)), "v_cache"),
    ("block_attention", "k_cache_4d", setitem("k_cache", lambda t: t[None]), "k_cache"),
    ("block_attention", "k_cache_noncontiguous", setitem("k_cache", noncontig), "k_cache must be contiguous"),
    ("block_attention", "v_cache_noncontiguous", setitem("v_cache", lambda t: torch.randn(ATT_S, HKV, 2 * D)[..., ::2]), "v_cache must be contiguous"),
    ("block_attention", "cache_offsets_int32", setitem("cache_offsets", lambda t: t.int()), "cache_offsets"),
    ("block_attention", "cache_lens_float", setitem("cache_lens", lambda t: t.float()), "cache_lens"),
    ("block_attention", "cache_lens_len", setitem("cache_lens", lambda t: torch.tensor([3, 0, 1])), "cache_lens"),
    ("block_attention", "cache_offsets_2d", setitem("cache_offsets", lambda t: t[None]), "cache_offsets"),
    ("block_attention", "cache_lens_negative", index_value("cache_lens", 1, -1), r"cache_lens\[1\]"),
    ("block_attention", "cache_offsets_negative", index_value("cache_offsets", 0, -2), r"cache_offsets\[0\]"),
    ("block_attention", "context_past_end", lambda a: a.update(cache_offsets=torch.tensor([0, 5]), cache_lens=torch.tensor([9, ATT_S - 4])),
     r"cache_offsets\[1\].*cache_lens\[1\].*past the end"),
    ("block_attention", "offset_past_end_len0", lambda a: a.update(cache_offsets=torch.tensor([0, ATT_S + 1]), cache_lens=torch.tensor([9, 0])),
     r"cache_offsets\[1\].*past the end"),
    ("block_attention", "window_negative", lambda a: a.update(window=-1), "window"),
    ("block_attention", "window_negative_causal", lambda a: a.update(window=-1, causal=True), "window"),
    ("block_attention", "context_past_end_causal", lambda a: a.update(cache_offsets=torch.tensor([0, 5]), cache_lens=torch.tensor([9, ATT_S - 4]), causal=True),
     r"cache_offsets\[1\].*cache_lens\[1\].*past the end"),
    ("block_attention", "causal_and_symmetric", lambda a: a.update(causal=True, symmetric=True),
     "causal and symmetric exclude each other"),
    ("block_attention", "max_context_symmetric", lambda a: a.update(window=3, symmetric=True, max_context=1),
     r"sequence 0 sees 2 context rows \(cache_lens\[0\] = 3, window 3, symmetric\) but max_context is 1"),
    ("block_attention", "window_negative_symmetric", lambda a: a.update(window=-1, symmetric=True), "window"),
    ("block_attention", "context_past_end_symmetric", lambda a: a.update(cache_offsets=torch.tensor([0, 5]), cache_lens=torch.tensor([9, ATT_S - 4]), symmetric=True),
     r"cache_offsets\[1\].*cache_lens\[1\].*past the end"),
    ("block_attention", "scale_nan", lambda a: a.update(scale=float("nan")), "scale"),
    ("block_attention", "scale_inf", lambda a: a.update(scale=float("inf")), "scale"),
    # --- skinny_linear ----------------------------------------------------------------
    ("skinny_linear", "x_float64", setitem("x", lambda t: t.double()), r"\bx\b"),
    ("skinny_linear", "x_int64", setitem("x", lambda t: t.long()), r"\bx\b"),
    ("skinny_linear", "x_0d", setitem("x", lambda t: t[0, 0]), r"\bx\b"),
    ("skinny_linear", "weight_bf16", setitem("weight", lambda t: t.bfloat16()), "weight"),
    ("skinny_linear", "weight_width", setitem("weight", lambda t: randn(8, H + 1)), "weight"),
    ("skinny_linear", "weight_1d", setitem("weight", lambda t: t[0]), "weight"),
    ("skinny_linear", "bias_fp16", setitem("bias", lambda t: t.half()), "bias"),
    ("skinny_linear", "bias_len", setitem("bias", lambda t: randn(9)), "bias"),
    ("skinny_linear", "bias_2d", setitem("bias", lambda t: t[None]), "bias"),
]


def tensors_of(kwargs):
    for v in kwargs.values():
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, torch.Tensor):
                yield t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,mutate,match", [pytest.param(o, m, r, id=f"{o}-{i}") for o, i, m, r in BAD])
def test_bad_input_raises(op, mutate, match, device):
    kwargs = base_kwargs(op)
    mutate(kwargs)
    kwargs = to_device(kwargs, device)
    before = [t.clone() for t in tensors_of(kwargs)]
    with pytest.raises(RuntimeError, match=match):
        OPS[op](**kwargs)
    for a, b in zip(before, tensors_of(kwargs)):  # nothing written (inject checks everything first)
        assert same_or_both_nan(a, b)


def test_base_inputs_are_valid():
    assert base_kwargs("block_attention")["k_cache"].shape[0] == ATT_S
    for op, fn in OPS.items():
        fn(**base_kwargs(op))


# One tensor on another device than the rest. Without CUDA a 'meta' tensor among CPU ones
# stands in for the second device; with CUDA, one CPU tensor among CUDA ones is tried too.
DEVICE_MISMATCH = [
    ("project_features", "features", r"features\[1\]"),
    ("project_features", "fc_weight", "fc_weight"),
    ("inject_context_kv", "k_weight", "k_weight"),
    ("inject_context_kv", "positions", "positions"),
    ("block_attention", "k_block", "k_block"),
    ("block_attention", "cache_lens", "cache_lens"),
    ("skinny_linear", "weight", "weight"),
    ("skinny_linear", "bias", "bias"),
]


@pytest.mark.parametrize("devices", [
    pytest.param(("cpu", "meta"), id="cpu+meta"),
    pytest.param(("cuda", "cpu"), id="cuda+cpu", marks=pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")),
])
@pytest.mark.parametrize("op,arg,match", [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in DEVICE_MISMATCH])
def test_device_mismatch_raises(op, arg, match, devices):
    main, other = devices
    kwargs = to_device(base_kwargs(op), main)
    if arg == "features":
        kwargs[arg] = [kwargs[arg][0], kwargs[arg][1].to(other)]
    else:
        kwargs[arg] = kwargs[arg].to(other)
    with pytest.raises(RuntimeError, match=match):
        OPS[op](**kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_error_messages_keep_their_numbers(device):
    # A library linked with a private static libstdc++ loses (or crashes on) the numbers in
    # its messages: seen with the CUDA image's /opt/gcc compiler (setup.py probes for it too).
    features, fc_weight, norm_weight, _ = make_project_inputs(3, 8, 2, 8, device=device)
    with pytest.raises(RuntimeError, match=r"eps must be finite and >= 0, got -0\.25"):
        dflash_ext.project_features(features, fc_weight, norm_weight, -0.25)
    kwargs = to_device(base_kwargs("block_attention"), device)
    with pytest.raises(RuntimeError, match=r"window must be >= 0 \(0 = no window\), got -3"):
        dflash_ext.block_attention(**{**kwargs, "window": -3})
