"""block_attention against reference.block_attention, non-causal, causal and with a
symmetric window; causal also against F.scaled_dot_product_attention(is_causal=True), causal
and symmetric against a per-query loop of slices, symmetric against the plain-torch
drafter.windowed_bidirectional_attention that the drafter ran before the op had the rule.

Every cache row the op must not read (outside each sequence's windowed context) is NaN,
so an out-of-range read shows up as a NaN output."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import dflash_ext
from dflash_ext.ops import reference
from dflash_ext.testing.inputs import make_attention_inputs

from python_tests.helpers import DEVICES, DTYPES, HAS_CUDA, assert_close, check_attention

HEADS = [pytest.param(4, 4, id="mha4"), pytest.param(9, 3, id="gqa9x3"), pytest.param(32, 8, id="gqa32x8")]
RAGGED = [0, 13, 1, 40]  # cache lengths of a batch of 4, one empty


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 5], ids=["nowindow", "window5"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_matches_reference(Hq, Hkv, D, window, dtype, device):
    check_attention(make_attention_inputs(RAGGED, 4, Hq, Hkv, D, window=window, dtype=dtype,
                                          device=device, seed=Hq + D + window))


# (lens, Bq, Hq, Hkv, D, window): other batch shapes, block sizes and windows.
CASES = [
    ([7], 1, 4, 4, 64, 0),
    ([0], 16, 9, 3, 128, 0),          # no context at all: attention over the block only
    ([0, 0, 0], 3, 4, 4, 64, 4),
    ([100, 0, 3, 64, 1], 16, 32, 8, 64, 0),
    ([100, 0, 3, 64, 1], 16, 32, 8, 64, 32),
    ([30, 31, 29], 2, 9, 3, 64, 30),  # window = one length: smaller, equal, larger
    ([50], 8, 4, 4, 128, 1),
    ([50], 8, 4, 4, 128, 49),
    ([50], 8, 4, 4, 128, 51),
    ([50], 8, 4, 4, 128, 10_000),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", CASES)
def test_cases(lens, Bq, Hq, Hkv, D, window, dtype, device):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype,
                                          device=device, seed=len(lens) + Bq + window))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 20, 200])
def test_context_is_whole_cache(window, dtype, device):
    inp = make_attention_inputs([64], 4, 9, 3, 64, window=window, dtype=dtype, device=device,
                                seed=3, gap=0)
    assert inp.k_cache.shape[0] == 64 and inp.cache_offsets.item() == 0
    check_attention(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_context_at_cache_end(dtype, device):
    """A sequence with no context whose offset is S (one past the last row) is valid."""
    inp = make_attention_inputs([6, 0], 2, 4, 4, 64, dtype=dtype, device=device, seed=9, gap=0)
    assert inp.cache_offsets.tolist() == [0, 6] and inp.k_cache.shape[0] == 6
    check_attention(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", ["default", "many"])
@pytest.mark.parametrize("rule", ["bidir", "causal", "symmetric"])
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", [
    ([3000], 16, 4, 4, 128, 0),
    ([3100], 1, 9, 3, 64, 0),
    ([3000], 16, 32, 8, 64, 2500),
    ([3100, 0, 17], 1, 4, 4, 64, 0),  # short sequences get empty splits
    ([3100, 0, 17], 16, 9, 3, 64, 0),  # causal: splits of the block that its first queries see none of
    ([2000, 5000], 16, 9, 3, 128, 0),
    ([3100, 0, 17], 16, 9, 3, 64, 700),
    ([2000, 5000], 16, 9, 3, 128, 3000),
    ([3000, 40], 16, 4, 4, 128, 6),  # causal, symmetric: splits that most queries see none of
])
def test_long_context_splits(lens, Bq, Hq, Hkv, D, window, rule, threads, dtype, device, request):
    """Long contexts (> kMinSplitKeys keys per split) take the split-KV path; with 16
    threads the CPU kernel splits even with many KV heads on a 2-core machine."""
    if threads == "many":
        request.getfixturevalue("many_threads")
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=rule == "causal",
                                          symmetric=rule == "symmetric", dtype=dtype, device=device,
                                          seed=sum(lens) + Bq, q_std=1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_scales(scale, dtype, device):
    """A nearly flat and a very peaked softmax (logits of std ~17 with scale 1, D 128)."""
    inp = make_attention_inputs([600, 5], 4, 4, 4, 128, dtype=dtype, device=device, seed=4)
    check_attention(dataclasses.replace(inp, scale=scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_and_overlapping_contexts(dtype, device):
    """Sequences may read the same cache rows (a shared prefix)."""
    inp = make_attention_inputs([40], 4, 9, 3, 64, dtype=dtype, device=device, seed=5, poison=False)
    inp = dataclasses.replace(
        inp, q=inp.q.expand(3, -1, -1, -1).clone(), k_block=inp.k_block.repeat(3, 1, 1, 1),
        v_block=inp.v_block.repeat(3, 1, 1, 1),
        cache_offsets=torch.tensor([0, 0, 10], device=device),
        cache_lens=torch.tensor([43, 20, 33], device=device))
    out = check_attention(inp)
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_inputs(dtype, device):
    """q / k_block / v_block given as permuted views, index tensors as strided views."""
    inp = make_attention_inputs(RAGGED, 4, 9, 3, 64, window=7, dtype=dtype, device=device, seed=6)
    nc = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    strided = lambda t: torch.stack([t, t], 1)[:, 0]
    inp = dataclasses.replace(inp, q=nc(inp.q), k_block=nc(inp.k_block), v_block=nc(inp.v_block),
                              cache_offsets=strided(inp.cache_offsets), cache_lens=strided(inp.cache_lens))
    for t in (inp.q, inp.k_block, inp.v_block, inp.cache_offsets):
        assert not t.is_contiguous()
    out = check_attention(inp)
    assert out.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Bsz,Bq", [(0, 4), (2, 0)])
def test_empty(Bsz, Bq, dtype, device):
    inp = make_attention_inputs([3] * Bsz, Bq, 9, 3, 64, dtype=dtype, device=device)
    out = dflash_ext.block_attention(*inp.args())
    assert out.shape == (Bsz, Bq, 9, 64) and out.dtype == dtype and out.device.type == device


def test_inputs_untouched_and_deterministic():
    inp = make_attention_inputs(RAGGED, 4, 9, 3, 64, seed=7, poison=False)
    before = [t.clone() for t in inp.args() if isinstance(t, torch.Tensor)]
    out1, out2 = dflash_ext.block_attention(*inp.args()), dflash_ext.block_attention(*inp.args())
    assert torch.equal(out1, out2)
    for a, b in zip(before, [t for t in inp.args() if isinstance(t, torch.Tensor)]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", [
    (RAGGED, 4, 9, 3, 64, 0),
    ([100, 0, 3], 16, 32, 8, 128, 32),
    ([3000], 16, 4, 4, 64, 0),
])
def test_blas_fallback(lens, Bq, Hq, Hkv, D, window, dtype, blas_fallback, many_threads):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype, seed=8))


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 700), min_size=1, max_size=4), Bq=st.integers(1, 17),
       Hkv=st.integers(1, 4), group=st.integers(1, 4), D=st.sampled_from([1, 3, 8, 20, 64, 128]),
       window=st.one_of(st.just(0), st.integers(1, 20), st.integers(1, 800)),
       rule=st.sampled_from(["bidir", "causal", "symmetric"]), threads=st.sampled_from([1, 2, 16]),
       seed=st.integers(0, 2**31 - 1))
def test_property_fp32(lens, Bq, Hkv, group, D, window, rule, threads, seed):
    flags = dict(causal=rule == "causal", symmetric=rule == "symmetric")
    inp = make_attention_inputs(lens, Bq, Hkv * group, Hkv, D, window=window, seed=seed, q_std=1.0, **flags)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = dflash_ext.block_attention(*inp.args(), **flags)
    finally:
        torch.set_num_threads(prev)
    assert_close(out, reference.block_attention(*inp.args(), **flags))


CUDA_HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", CUDA_HALF)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", [
    pytest.param([32768], 16, 32, 8, 128, 0, id="qwen3-32k-b1"),
    pytest.param([32768, 5, 20000, 0], 16, 32, 8, 128, 0, id="qwen3-ragged-b4"),
    pytest.param([16384] * 16, 16, 32, 8, 128, 0, id="qwen3-16k-b16"),
    pytest.param([32768, 1000], 16, 32, 8, 128, 4096, id="qwen3-window"),
    pytest.param([32768], 16, 9, 3, 64, 0, id="smollm2-32k"),
    pytest.param([40000], 3, 12, 4, 64, 0, id="odd-rows-many-splits"),
])
def test_cuda_long_contexts_many_splits(lens, Bq, Hq, Hkv, D, window, dtype):
    """Long contexts on the GPU: the split-KV path with up to 128 splits, empty splits for
    short sequences, and the log-sum-exp combine."""
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype,
                                          device="cuda", seed=len(lens) + Bq, q_std=1.0))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [32, 96, 256])
def test_cuda_other_head_dims_take_the_simple_path(D, dtype):
    check_attention(make_attention_inputs([700, 3], 4, 8, 2, D, dtype=dtype, device="cuda", seed=D))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_cuda_head_dim_above_256_is_an_error():
    inp = make_attention_inputs([10], 2, 2, 1, 320, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="head dims up to 256"):
        dflash_ext.block_attention(*inp.args())


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", CASES[:6])
def test_every_cpu_isa_path(lens, Bq, Hq, Hkv, D, window, dtype, causal, cpu_isa_level):
    """Each dispatch path this CPU can take (forced lower levels included) meets the reference."""
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=causal, dtype=dtype,
                                          seed=len(lens) + Bq + window + 1))


# Shapes on both sides of the CPU path rule (flash at >= 1024 keys or >= 32 query rows per
# KV head, where bf16 has bf16 units): long ragged contexts with an empty one, a window, GQA;
# windows under Bq (causal: the later queries see no context row, only block keys).
FLASH_CASES = [
    ([1500, 0, 1100], 4, 9, 3, 64, 0),
    ([1200], 16, 9, 3, 64, 1100),
    ([40, 3], 16, 8, 2, 128, 0),
    ([1000], 2, 4, 4, 64, 0),
    ([40, 3, 0], 16, 8, 2, 128, 5),
    ([1300, 2], 16, 4, 2, 64, 1),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", FLASH_CASES)
def test_long_contexts_and_many_queries(lens, Bq, Hq, Hkv, D, window, dtype, causal, cpu_isa_level):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=causal, dtype=dtype,
                                          seed=sum(lens) + Bq))


# --------------------------------------------------------------------------- causal
# (lens, Bq, Hq, Hkv, D, window): no context, windows 1 and 3, under / equal to / over Bq,
# over n, n = window - 1 (the first query sees the whole context), ragged batches, GQA.
CAUSAL_CASES = [
    ([0], 1, 4, 4, 64, 0),
    ([0], 16, 9, 3, 64, 0),
    ([0, 0], 6, 4, 2, 64, 3),
    ([7], 1, 4, 4, 64, 0),
    ([7], 1, 4, 4, 64, 3),
    ([5], 16, 8, 2, 64, 3),
    ([300], 16, 32, 8, 64, 1),
    ([300, 0, 7, 64], 4, 9, 3, 64, 3),
    ([2], 8, 4, 4, 128, 5),
    ([100, 1, 40], 16, 8, 2, 128, 20),
    ([10, 3], 5, 4, 2, 64, 400),
    ([290, 17], 12, 12, 4, 64, 0),
    ([64, 65], 16, 4, 4, 64, 16),
    ([63], 3, 6, 3, 20, 64),
    ([299, 0, 150], 16, 32, 4, 128, 150),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", CAUSAL_CASES)
def test_causal_cases(lens, Bq, Hq, Hkv, D, window, causal, dtype, device):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=causal, dtype=dtype,
                                          device=device, seed=sum(lens) + Bq + window))


def sdpa_causal(q, k, v, scale, compute_dtype):
    """F.scaled_dot_product_attention(is_causal=True) of [Bsz, Bq, H*, D] tensors, GQA by repeat."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2).to(compute_dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Bsz,Bq,Hq,Hkv,D", [(1, 1, 4, 4, 64), (3, 16, 9, 3, 64), (2, 7, 8, 2, 128), (1, 16, 4, 1, 20)])
def test_causal_without_context_is_sdpa_is_causal(Bsz, Bq, Hq, Hkv, D, dtype, device):
    """causal=True, window 0, no context: plain causal attention over the block."""
    inp = make_attention_inputs([0] * Bsz, Bq, Hq, Hkv, D, causal=True, dtype=dtype, device=device, seed=Bq + D)
    out = dflash_ext.block_attention(*inp.args(), causal=True)
    ref32 = sdpa_causal(inp.q, inp.k_block, inp.v_block, inp.scale, torch.float32).to(dtype)
    lowp = sdpa_causal(inp.q, inp.k_block, inp.v_block, inp.scale, dtype) if dtype != torch.float32 else None
    assert_close(out, ref32, lowp)


def per_query_loop(inp: "dflash_ext.testing.AttentionInputs") -> torch.Tensor:
    """Causal or symmetric block_attention one query at a time (fp32): the context rows and
    block keys it sees sliced by hand from the rule's bounds, then unmasked SDPA over them."""
    Bsz, Bq, Hq, D = inp.q.shape
    group, w = Hq // inp.k_block.shape[2], inp.window
    out = torch.empty(inp.q.shape, dtype=torch.float32, device=inp.q.device)
    for b in range(Bsz):
        off, n = int(inp.cache_offsets[b]), int(inp.cache_lens[b])
        for i in range(Bq):
            ctx_from = max(0, n + i - w + 1) if w > 0 else 0  # context rows r with n + i - r < w
            blk_from = max(0, i - w + 1) if w > 0 else 0  # block keys j <= i with i - j < w
            # causal: up to itself; symmetric: |i - j| < w on both sides (w = 0: all)
            blk_to = i + 1 if inp.causal else min(Bq, i + w) if w > 0 else Bq
            k = torch.cat([inp.k_cache[off + ctx_from:off + n], inp.k_block[b, blk_from:blk_to]])
            v = torch.cat([inp.v_cache[off + ctx_from:off + n], inp.v_block[b, blk_from:blk_to]])
            k, v = (t.float().transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))  # [Hq, L, D]
            qi = inp.q[b, i].float()[:, None]  # [Hq, 1, D]
            out[b, i] = F.scaled_dot_product_attention(qi, k, v, scale=inp.scale)[:, 0]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", CAUSAL_CASES)
def test_causal_is_a_per_query_loop_of_slices(lens, Bq, Hq, Hkv, D, window, device):
    inp = make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=True, device=device, seed=len(lens) + Bq)
    assert_close(dflash_ext.block_attention(*inp.args(), causal=True), per_query_loop(inp))
    assert_close(reference.block_attention(*inp.args(), causal=True), per_query_loop(inp), what="reference")


def test_causal_differs_where_it_should():
    """Causal with window 0 changes every query but the last (which sees the whole block), and
    the first query's output is the same whatever the later block keys hold."""
    inp = make_attention_inputs([20], 6, 4, 2, 64, seed=11, poison=False)
    bidir = dflash_ext.block_attention(*inp.args())
    causal = dflash_ext.block_attention(*inp.args(), causal=True)
    assert torch.equal(causal[:, -1], bidir[:, -1])
    assert all(not torch.allclose(causal[:, i], bidir[:, i]) for i in range(5))
    later = dataclasses.replace(inp, k_block=inp.k_block.clone(), v_block=inp.v_block.clone())
    later.k_block[:, 1:] += 1.0
    later.v_block[:, 1:] -= 2.0
    again = dflash_ext.block_attention(*later.args(), causal=True)
    torch.testing.assert_close(again[:, 0], causal[:, 0], rtol=0, atol=0)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", CUDA_HALF)
@pytest.mark.parametrize("rule", ["causal", "symmetric"])
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", [
    pytest.param([32768, 1000], 16, 32, 8, 128, 4096, id="qwen3-window"),
    pytest.param([32768, 5, 20000, 0], 16, 32, 8, 128, 0, id="qwen3-ragged-b4"),
    pytest.param([32768, 5, 20000, 0], 16, 32, 8, 128, 2048, id="qwen3-ragged-b4-dflash2-window"),
    pytest.param([40000], 3, 12, 4, 64, 0, id="odd-rows-many-splits"),
    pytest.param([40000], 3, 12, 4, 64, 30000, id="odd-rows-many-splits-window"),
    pytest.param([5000, 3, 0], 16, 32, 4, 128, 8, id="two-row-tiles-window-under-bq"),
    pytest.param([9000], 16, 16, 2, 64, 1, id="window-1"),
    pytest.param([16384] * 8, 8, 32, 8, 128, 0, id="qwen3-16k-b8"),
])
def test_cuda_per_query_long_contexts_many_splits(lens, Bq, Hq, Hkv, D, window, rule, dtype):
    """Causal and symmetric on the tensor-core split-KV path and the combine launch: splits
    some rows see none of, row tiles of several queries (group 8: 2 tiles of 64 rows),
    windows under Bq (symmetric window 0: the unmasked kernel)."""
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, causal=rule == "causal",
                                          symmetric=rule == "symmetric", dtype=dtype, device="cuda",
                                          seed=len(lens) + Bq, q_std=1.0))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", CUDA_HALF)
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 3])
def test_cuda_causal_rows_that_see_none_of_a_split(ctas_per_sm, dtype):
    """A short sequence whose last split holds only block keys past its first two queries:
    they see none of it (l = 0, lse = -inf in the combine). The split length is the plan
    rule's for this GPU at an assumed occupancy (the kernel's own is one of these)."""
    Bq, Hq, Hkv, longest = 16, 8, 2, 20000
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits, tiles = dflash_ext._C._cuda_plan("attention", 2 * Hkv, longest + Bq, 64, sms, ctas_per_sm)
    assert splits > 1
    n = tiles * 64 - 2  # its keys past tiles * 64 form a split; queries 0 and 1 see up to n + 1
    check_attention(make_attention_inputs([longest, n], Bq, Hq, Hkv, 64, causal=True, dtype=dtype, device="cuda",
                                          seed=ctas_per_sm, q_std=1.0))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", ["causal", "symmetric"])
@pytest.mark.parametrize("D", [32, 96, 256])
@pytest.mark.parametrize("window", [0, 3, 300])
def test_cuda_per_query_other_head_dims_take_the_simple_path(D, window, rule, dtype):
    check_attention(make_attention_inputs([700, 3, 0], 6, 8, 2, D, window=window, causal=rule == "causal",
                                          symmetric=rule == "symmetric", dtype=dtype, device="cuda", seed=D))


# --------------------------------------------------------------------------- symmetric window
# The bidirectional sliding layers of DFlash2's published configs: the query at p sees the
# keys at |p - k| < W over [context ; block]. The causal cases' shapes (windows 1 and 3,
# under / equal to / over Bq, over n, no context, ragged batches, GQA) and a window 0 case.
SYMMETRIC_CASES = CAUSAL_CASES + [([40, 3, 0], 16, 8, 2, 128, 5), ([1], 16, 4, 4, 64, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", SYMMETRIC_CASES)
def test_symmetric_cases(lens, Bq, Hq, Hkv, D, window, dtype, device):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, symmetric=True, dtype=dtype,
                                          device=device, seed=sum(lens) + Bq + window + 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", SYMMETRIC_CASES)
def test_symmetric_is_a_per_query_loop_of_slices(lens, Bq, Hq, Hkv, D, window, device):
    inp = make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, symmetric=True, device=device,
                                seed=len(lens) + Bq + 1)
    assert_close(dflash_ext.block_attention(*inp.args(), symmetric=True), per_query_loop(inp))
    assert_close(reference.block_attention(*inp.args(), symmetric=True), per_query_loop(inp), what="reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", FLASH_CASES)
def test_symmetric_long_contexts_and_many_queries(lens, Bq, Hq, Hkv, D, window, dtype, cpu_isa_level):
    """Both CPU paths (flash and the tiled kernel) and every ISA level this CPU takes."""
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, symmetric=True, dtype=dtype,
                                          seed=sum(lens) + Bq + 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_without_window_is_bidirectional(dtype, device):
    inp = make_attention_inputs(RAGGED, 6, 9, 3, 64, dtype=dtype, device=device, seed=12)
    torch.testing.assert_close(dflash_ext.block_attention(*inp.args(), symmetric=True),
                               dflash_ext.block_attention(*inp.args()), rtol=0, atol=0)


def test_symmetric_differs_where_it_should():
    """Window 3, Bq 6: query 0 sees block keys 0..2 only, so changing keys 3.. leaves it as it
    was and changes query 5 (which sees 3..5); the context it sees is the last 2 rows."""
    inp = make_attention_inputs([20], 6, 4, 2, 64, window=3, symmetric=True, seed=13, poison=False)
    out = dflash_ext.block_attention(*inp.args(), symmetric=True)
    later = dataclasses.replace(inp, k_block=inp.k_block.clone(), v_block=inp.v_block.clone())
    later.k_block[:, 3:] += 1.0
    later.v_block[:, 3:] -= 2.0
    again = dflash_ext.block_attention(*later.args(), symmetric=True)
    torch.testing.assert_close(again[:, 0], out[:, 0], rtol=0, atol=0)
    assert not torch.allclose(again[:, 5], out[:, 5])
    old = dataclasses.replace(inp, k_cache=inp.k_cache.clone(), v_cache=inp.v_cache.clone())
    old.k_cache[:int(inp.cache_offsets[0]) + 18] = float("nan")  # all but the last 2 context rows
    torch.testing.assert_close(dflash_ext.block_attention(*old.args(), symmetric=True), out, rtol=0, atol=0)


def draft_cache_inputs(lens, capacity, Bq, Hq, Hkv, D, dtype, device, seed):
    """A draft cache as DraftCache lays it out (sequence b at rows b * capacity) with random
    rows everywhere, block q/K/V, offsets and lens."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    Bsz = len(lens)
    return (rand(Bsz, Bq, Hq, D) * 1.5, rand(Bsz, Bq, Hkv, D), rand(Bsz, Bq, Hkv, D), rand(Bsz * capacity, Hkv, D),
            rand(Bsz * capacity, Hkv, D), torch.arange(Bsz, device=device) * capacity,
            torch.tensor(lens, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,capacity,Bq,Hq,Hkv,D,window", [
    ([12], 16, 4, 4, 4, 64, 3),
    ([0, 5, 40], 48, 16, 8, 2, 128, 8),
    ([100, 1], 128, 16, 32, 8, 64, 1),
    ([30, 200], 256, 8, 9, 3, 64, 64),
    ([700], 1024, 16, 32, 8, 128, 2048),  # DFlash2's published window, longer than the context
    ([1500, 3], 1536, 16, 4, 1, 64, 600),
])
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "graph"])
def test_symmetric_is_windowed_bidirectional_attention(lens, capacity, Bq, Hq, Hkv, D, window, validate, dtype,
                                                       device):
    """The op with symmetric=True, at the draft cache's offsets, is what draft_hidden ran in
    plain torch for a symmetric layer (drafter.windowed_bidirectional_attention); with
    validate=False planned for the cache's capacity, as a CUDA graph runs it."""
    from dflash_ext.model.masks import windowed_bidirectional_attention
    q, kb, vb, kc, vc, offsets, cache_lens = draft_cache_inputs(lens, capacity, Bq, Hq, Hkv, D, dtype, device,
                                                               seed=sum(lens) + window)
    args, scale = (q, kb, vb, kc, vc, offsets, cache_lens, D ** -0.5), D ** -0.5
    fused = dict(max_context=-1 if validate else capacity, validate=validate)
    out = dflash_ext.block_attention(*args, window=window, symmetric=True, **fused)
    plain = windowed_bidirectional_attention(q, kb, vb, kc, vc, capacity, cache_lens, scale, window)
    ref32 = reference.block_attention(*args, window=window, symmetric=True)
    lowp = None if dtype == torch.float32 else reference.block_attention(*args, window=window, symmetric=True,
                                                                         compute_dtype=dtype)
    assert_close(out, ref32, lowp)
    assert_close(plain, ref32, lowp, what="windowed_bidirectional_attention")
    if dtype == torch.float32:  # both fp32 throughout: the same numbers but for summation order
        torch.testing.assert_close(out, plain, rtol=2e-5, atol=2e-5)


def test_causal_and_symmetric_exclude_each_other():
    inp = make_attention_inputs([5], 2, 4, 4, 64, window=3)
    with pytest.raises(RuntimeError, match="causal and symmetric exclude each other"):
        dflash_ext.block_attention(*inp.args(), causal=True, symmetric=True)
    with pytest.raises(ValueError, match="causal and symmetric exclude each other"):
        reference.block_attention(*inp.args(), causal=True, symmetric=True)
