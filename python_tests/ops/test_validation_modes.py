"""validate= and max_context= of the ops (ops.py): what validation off means, on every
device. The CPU always validates; on CUDA validate=False reads no index on the host and
the kernels' guards keep every access inside the tensors (CUDA cases skip without a GPU)."""
import dataclasses

import pytest
import torch

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_attention_inputs, make_inject_inputs

from python_tests.helpers import DEVICES, HAS_CUDA, same_or_both_nan

CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")


@pytest.mark.parametrize("slots,positions,match", [
    ([0, 9, 2], [0, 1, 2], r"slots\[1\]"), ([0, 1, -3], [0, 1, 2], r"slots\[2\]"),
    ([0, 1, 2], [0, 99, 2], r"positions\[1\]"), ([4, 4, 1], [0, 1, 2], "repeat")])
def test_cpu_validates_even_when_told_not_to(slots, positions, match):
    inp = make_inject_inputs(3, 16, 2, 2, 8, S=8, P=10)
    inp.slots, inp.positions = torch.tensor(slots), torch.tensor(positions)
    before = inp.k_cache.clone()
    with pytest.raises(RuntimeError, match=match):
        dflash_ext.inject_context_kv(*inp.args(), validate=False)
    assert same_or_both_nan(before, inp.k_cache)
    att = make_attention_inputs([3, 4], 2, 4, 2, 8)
    att.cache_lens = torch.tensor([3, 99])
    with pytest.raises(RuntimeError, match="past the end"):
        dflash_ext.block_attention(*att.args(), validate=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_max_context_above_the_lens_changes_nothing(device, dtype, window, validate, causal):
    inp = make_attention_inputs([9, 0, 300], 4, 8, 2, 64, window=window, causal=causal, dtype=dtype, device=device)
    want = dflash_ext.block_attention(*inp.args(), causal=causal)
    for bound in (300, 301, 4096):
        got = dflash_ext.block_attention(*inp.args(), max_context=bound, validate=validate, causal=causal)
        torch.testing.assert_close(got, want, rtol=0, atol=0) if device == "cpu" else \
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_max_context_below_a_visible_context_raises_when_validating(device):
    inp = make_attention_inputs([9, 30], 2, 4, 2, 8, device=device)
    with pytest.raises(RuntimeError, match=r"sequence 1 sees 30 context rows.*max_context is 29"):
        dflash_ext.block_attention(*inp.args(), max_context=29)
    inp.window = 20  # the window counts: 20 rows are visible
    dflash_ext.block_attention(*inp.args(), max_context=20)
    # causal: the first query sees window - 1 = 19 rows, the most any query sees
    dflash_ext.block_attention(*inp.args(), max_context=19, causal=True)
    with pytest.raises(RuntimeError, match=r"sequence 1 sees 19 context rows.*causal.*max_context is 18"):
        dflash_ext.block_attention(*inp.args(), max_context=18, causal=True)
    with pytest.raises(RuntimeError, match="max_context must be"):
        dflash_ext.block_attention(*inp.args(), max_context=-2)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,N,Hkv,D", [(64, 3, 2, 64), (64, 3, 2, 96), (4096, 5, 8, 128)],
                         ids=["one-k-tile", "simt-D96", "qwen3-8b-split-k"])
def test_cuda_bad_inject_indices_without_validation_write_only_the_good_rows(dtype, H, N, Hkv, D):
    T, S, P = 24, 40, 50  # qwen3-8b-split-k: 80 CTAs on the SMs, so the plan splits K (finalize pass)
    inp = make_inject_inputs(T, H, N, Hkv, D, S=S, P=P, dtype=dtype, device="cuda", skip_frac=0.0)
    slots = torch.randperm(S)[:T]
    positions = torch.randint(0, P, (T,))
    slots[0], slots[1], slots[2] = S, S + 1000, -7          # slots outside [-1, S)
    positions[3], positions[4] = P, -1                      # positions outside [0, P) with good slots
    slots[5] = -1                                           # an ordinary skip
    inp.slots, inp.positions = slots.cuda(), positions.cuda()
    before_k, before_v = inp.k_cache.clone(), inp.v_cache.clone()
    dflash_ext.inject_context_kv(*inp.args(), validate=False)
    torch.cuda.synchronize()
    good = torch.ones(T, dtype=torch.bool)
    good[:6] = False
    rows = slots[good].cuda()
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    for got, before in ((inp.k_cache, before_k), (inp.v_cache, before_v)):
        assert same_or_both_nan(got[:, untouched], before[:, untouched]), "a row outside the good slots was written"
    ref_k, ref_v = torch.zeros_like(inp.k_cache), torch.zeros_like(inp.v_cache)
    ok = good.cuda()  # the reference over the good tokens only
    reference.inject_context_kv(inp.ctx[ok], inp.k_weight, inp.v_weight, inp.k_norm_weight, inp.cos, inp.sin,
                                inp.positions[ok], inp.slots[ok], ref_k, ref_v, inp.eps)
    for got, ref in ((inp.k_cache, ref_k), (inp.v_cache, ref_v)):
        torch.testing.assert_close(got[:, rows].float(), ref[:, rows].float(), rtol=3e-2, atol=3e-2)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bad_ranges_without_validation_are_clamped_to_the_cache(dtype):
    # no max_context: planned for the whole cache, split over its ~3,000 rows
    inp = make_attention_inputs([9, 30, 5, 3000], 4, 8, 2, 64, dtype=dtype, device="cuda", poison=False)
    S = inp.k_cache.shape[0]
    good_offset = int(inp.cache_offsets[3])
    inp.cache_offsets = torch.tensor([S - 4, -50, S + 7, good_offset], device="cuda")
    inp.cache_lens = torch.tensor([9, 30, 5, 3000], device="cuda")
    got = dflash_ext.block_attention(*inp.args(), validate=False)
    torch.cuda.synchronize()
    # clamped: offset into [0, S], len into [0, S - offset]
    clamped = make_attention_inputs([9, 30, 5, 3000], 4, 8, 2, 64, dtype=dtype, device="cuda", poison=False)
    clamped.cache_offsets = torch.tensor([S - 4, 0, S, good_offset], device="cuda")
    clamped.cache_lens = torch.tensor([4, 30, 0, 3000], device="cuda")
    want = reference.block_attention(*clamped.args())
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    # a visible context above max_context: its last max_context rows
    inp.cache_offsets, inp.cache_lens = clamped.cache_offsets.clone(), clamped.cache_lens.clone()
    got = dflash_ext.block_attention(*inp.args(), max_context=10, validate=False)
    clamped.window = 10
    torch.testing.assert_close(got.float(), reference.block_attention(*clamped.args()).float(), rtol=3e-2, atol=3e-2)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6, 40])
def test_cuda_causal_context_above_max_context_without_validation_is_its_last_rows(dtype, window):
    """Causal, validate=False: a sequence sees its last max_context rows, the rule applied at
    their true positions (the reference over the range narrowed to those rows)."""
    inp = make_attention_inputs([9, 30, 3000], 4, 8, 2, 64, window=window, causal=True, dtype=dtype,
                                device="cuda", poison=False)
    got = dflash_ext.block_attention(*inp.args(), max_context=10, validate=False, causal=True)
    lens = inp.cache_lens.cpu()
    kept = torch.clamp(lens, max=10)
    narrowed = dataclasses.replace(inp, cache_offsets=inp.cache_offsets + (lens - kept).cuda(), cache_lens=kept.cuda())
    want = reference.block_attention(*narrowed.args(), causal=True)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
