"""block_attention against reference.block_attention.

Every cache row the op must not read (outside each sequence's windowed context) is NaN,
so an out-of-range read shows up as a NaN output."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash_ext
from dflash_ext import reference
from dflash_ext.testing import make_attention_inputs

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
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", [
    ([3000], 16, 4, 4, 128, 0),
    ([3100], 1, 9, 3, 64, 0),
    ([3000], 16, 32, 8, 64, 2500),
    ([3100, 0, 17], 1, 4, 4, 64, 0),  # short sequences get empty splits
    ([2000, 5000], 16, 9, 3, 128, 0),
])
def test_long_context_splits(lens, Bq, Hq, Hkv, D, window, threads, dtype, device, request):
    """Long contexts (> kMinSplitKeys keys per split) take the split-KV path; with 16
    threads the CPU kernel splits even with many KV heads on a 2-core machine."""
    if threads == "many":
        request.getfixturevalue("many_threads")
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype,
                                          device=device, seed=sum(lens) + Bq, q_std=1.0))


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
       window=st.one_of(st.just(0), st.integers(1, 800)), threads=st.sampled_from([1, 2, 16]),
       seed=st.integers(0, 2**31 - 1))
def test_property_fp32(lens, Bq, Hkv, group, D, window, threads, seed):
    inp = make_attention_inputs(lens, Bq, Hkv * group, Hkv, D, window=window, seed=seed, q_std=1.0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = dflash_ext.block_attention(*inp.args())
    finally:
        torch.set_num_threads(prev)
    assert_close(out, reference.block_attention(*inp.args()))


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", CASES[:6])
def test_every_cpu_isa_path(lens, Bq, Hq, Hkv, D, window, dtype, cpu_isa_level):
    """Each dispatch path this CPU can take (forced lower levels included) meets the reference."""
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype,
                                          seed=len(lens) + Bq + window + 1))


# Shapes on both sides of the CPU path rule (flash at >= 1024 keys or >= 32 query rows per
# KV head, where bf16 has bf16 units): long ragged contexts with an empty one, a window, GQA.
FLASH_CASES = [
    ([1500, 0, 1100], 4, 9, 3, 64, 0),
    ([1200], 16, 9, 3, 64, 1100),
    ([40, 3], 16, 8, 2, 128, 0),
    ([1000], 2, 4, 4, 64, 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Bq,Hq,Hkv,D,window", FLASH_CASES)
def test_long_contexts_and_many_queries(lens, Bq, Hq, Hkv, D, window, dtype, cpu_isa_level):
    check_attention(make_attention_inputs(lens, Bq, Hq, Hkv, D, window=window, dtype=dtype,
                                          seed=sum(lens) + Bq))
