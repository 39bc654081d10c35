"""Shared helpers of the dflash_ext test suite: device/dtype parameters, the tolerance
rule and the checks of the ops built on it (written once, used by every test file; the
random input builders of every op are in dflash_ext.testing, shared with bench/ and
tools/gpu/; the fixtures live in conftest.py).

Tolerance rule
--------------
* float32: compare to the fp32 reference with ``rtol = 1e-4`` and ``atol = 1e-4 * max|ref|``.
* bfloat16 / float16 (the FA3 idiom): ``|ours - ref32| <= 2 * |ref_lowp - ref32| + atol``
  elementwise, where ``ref32`` is the reference run in fp32 on the same low-precision
  inputs and ``ref_lowp`` the reference run in the input dtype, and
  ``atol = ATOL_SCALE[dtype] * max|ref32|`` (covers one rounding of the output).
"""
import importlib.util
import os
from typing import Callable, Optional

import pytest
import torch

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import AttentionInputs, InjectInputs

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
# Checks of the ops on dflash_ext.testing's inputs
# --------------------------------------------------------------------------------------
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


def check_attention(inp: AttentionInputs, op: Callable = dflash_ext.block_attention) -> torch.Tensor:
    rule = dict(causal=inp.causal, symmetric=True) if inp.symmetric else dict(causal=inp.causal)
    return check_op(op, reference.block_attention, *inp.args(), **rule)
