"""skinny_linear against reference.skinny_linear (F.linear in fp32), and the decoding
loop's use of it (streamed_linears)."""
import pytest
import torch
from torch import nn

import dflash_ext
from dflash_ext import streamed_linears
from dflash_ext.ops import reference
from dflash_ext.ops.linear import linear_rows, skinny_linear_streams
from dflash_ext.testing.inputs import make_linear_inputs

from python_tests.helpers import DEVICES, DTYPES, check_op


# Rows 1..8 stream on the CPU, bf16 up to 16 on bf16 units and fp32 on AVX-512, 17 and 300 go to the library;
# K = 1536 / 576 are the SmolLM2 MLP and hidden widths, 33, 95 and 7 leave a remainder after
# the 16-float (32-bf16) steps; N = 49, 37, 3 leave weight rows after the kernels' groups.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 300]
SHAPES = [(576, 576), (200, 1536), (49, 33), (37, 95), (3, 7)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", ROWS)
def test_matches_reference(M, N, K, dtype, device):
    check_op(dflash_ext.skinny_linear, reference.skinny_linear,
             *make_linear_inputs(M, N, K, dtype=dtype, device=device, seed=M * N + K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4, 8, 12])
def test_bias(M, dtype, device):
    check_op(dflash_ext.skinny_linear, reference.skinny_linear,
             *make_linear_inputs(M, 96, 64, bias=True, dtype=dtype, device=device, seed=M))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_and_leading_dims(dtype, device):
    """Rows of a wider tensor (row stride > K), a column-strided x, a transposed-back
    weight, and x with two leading dims (flattened to rows, as nn.Linear takes them)."""
    x, w, b = make_linear_inputs(4, 48, 64, bias=True, dtype=dtype, device=device, seed=7)
    wide = torch.cat([x, x[:, :5]], 1)[:, :64]
    colstrided = torch.stack([x, x], -1).flatten(1)[:, ::2]
    w_nc = w.t().contiguous().t()
    assert wide.stride(0) == 69 and colstrided.stride(1) == 2 and not w_nc.is_contiguous()
    for xi in (wide, colstrided):
        check_op(dflash_ext.skinny_linear, reference.skinny_linear, xi, w_nc, b)
    x3 = x.view(2, 2, 64)
    out = dflash_ext.skinny_linear(x3, w, b)
    assert out.shape == (2, 2, 48)
    torch.testing.assert_close(out.view(4, 48), dflash_ext.skinny_linear(x, w, b), rtol=0, atol=0)


def _poisoned_inputs(M, N, K, dtype, seed):
    """x [M, K] and weight [N, K] whose memory goes on with NaN: x's rows are strided with NaN
    columns after K and NaN rows after M; weight is the first N rows of a contiguous buffer
    with NaN rows after them. A kernel reading past K, M or N returns NaN."""
    x, w, b = make_linear_inputs(M, N, K, bias=True, dtype=dtype, seed=seed)
    xbuf = torch.full((M + 3, K + 37), float("nan"), dtype=dtype)
    xbuf[:M, :K] = x
    wbuf = torch.full((N + 17, K), float("nan"), dtype=dtype)
    wbuf[:N] = w
    return xbuf[:M, :K], wbuf[:N], torch.stack([b, torch.full_like(b, float("nan"))], 1)[:, 0]


@pytest.mark.parametrize("N,K", [(576, 576), (37, 95), (19, 1100), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_and_row_count(cpu_isa_level, dtype, N, K):
    """1..17 rows at every ISA level this CPU has (the AVX-512 dot kernel: bf16 from
    avx512_bf16 up, fp32 from avx512 up; the AVX2 fp32 streaming kernel below), against the reference, on
    poisoned inputs (NaN past the rows, columns and weight rows the op may read) with a
    strided bias. K = 1100 is long enough for the multi-pass kernels to split the columns."""
    for M in range(1, 18):
        x, w, b = _poisoned_inputs(M, N, K, dtype, seed=M * 31 + N + K)
        assert x.stride(0) == K + 37 and b.stride(0) == 2 and w.is_contiguous()
        check_op(dflash_ext.skinny_linear, reference.skinny_linear, x, w, b)
        check_op(dflash_ext.skinny_linear, reference.skinny_linear, x, w, None)


def test_stream_rows_by_level(cpu_isa_level):
    """bf16 on bf16 units and fp32 on AVX-512 stream 1..16 rows whatever the weight (the dot
    kernel); fp32 on AVX2, and bf16 below avx512_bf16, 1..8 rows where the GEMM rule says tiles."""
    from dflash_ext.ops import hardware
    level = hardware.ISA_LEVELS.index(cpu_isa_level)
    units, avx512 = level >= hardware.ISA_LEVELS.index("avx512_bf16"), level >= hardware.ISA_LEVELS.index("avx512")
    for rows in (1, 8, 9, 16, 17):
        for weight_bytes in (1 << 10, 1 << 30):
            bf16 = hardware.cpu_paths(torch.bfloat16, rows=rows, weight_bytes=weight_bytes)["skinny_linear"]
            expected = rows <= 16 if units else rows <= 8
            assert (bf16 == "stream") == expected, (rows, weight_bytes, bf16)
        assert (hardware.cpu_paths(torch.float32, rows=rows)["skinny_linear"] == "stream") == \
            (rows <= (16 if avx512 else 8))


def test_a_row_does_not_depend_on_its_call(cpu_isa_level):
    """Each output row is summed in the same order whichever rows share the call, bit for bit,
    within each kernel's row counts: 1..16 rows in bf16 on bf16 units; in fp32 on AVX-512,
    1..2 rows (the AVX2 streaming kernel) and 3..16 (the AVX-512 dot kernel); 1..4 rows on the
    AVX2 streaming kernel below (what an exact verify that streams its linear layers relies
    on: docs/decoding.md). Columns 0 and 16 carry +-2^18, which cancel only if summed before
    the rest: another summation order moves most outputs by more than a bf16 step."""
    from dflash_ext.ops import hardware
    level = hardware.ISA_LEVELS.index(cpu_isa_level)
    units, avx512 = level >= hardware.ISA_LEVELS.index("avx512_bf16"), level >= hardware.ISA_LEVELS.index("avx512")
    cases = [(torch.float32, [range(1, 3), range(3, 17)] if avx512 else [range(1, 5)]),
             (torch.bfloat16, [range(1, 17) if units else range(1, 5)])]
    for dtype, kernels in cases:
        for N, K in [(53, 200), (40, 1100)]:
            x, w, b = make_linear_inputs(18, N, K, bias=True, dtype=dtype, seed=N + K)  # row i alone: rows i..i+2
            x[:, [0, 16]] = 1.0
            w[:, 0], w[:, 16] = 2.0 ** 18, -2.0 ** 18
            for counts in kernels:
                assert skinny_linear_streams(x[:counts[-1]], w)
                first = counts[0]
                alone = torch.cat([dflash_ext.skinny_linear(x[i:i + first], w, b)[:1] for i in range(counts[-1])])
                for M in counts:
                    assert torch.equal(dflash_ext.skinny_linear(x[:M], w, b), alone[:M]), (dtype, N, K, M)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_and_one_dim_input(device):
    x, w, _ = make_linear_inputs(3, 16, 8, device=device, seed=8)
    assert dflash_ext.skinny_linear(x[:0], w).shape == (0, 16)
    out = dflash_ext.skinny_linear(x[0], w)
    assert out.shape == (16,)
    torch.testing.assert_close(out, reference.skinny_linear(x[:1], w)[0], rtol=1e-4, atol=1e-5)


# ---- the decoding loop's use: streamed_linears ----------------------------------------
class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 40)
        self.b = nn.Linear(40, 24, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_streamed_linears_patches_and_restores(monkeypatch):
    model, x = TwoLayers(), torch.randn(1, 4, 32)
    calls = []
    real = dflash_ext.ops.skinny_linear
    monkeypatch.setattr(dflash_ext.ops, "skinny_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        plain = model(x)
        with streamed_linears(model):
            streamed = model(x)
            assert calls == [(1, 4, 32), (1, 4, 40)]
            model(torch.randn(1, 1, 32))               # one row: streamed too
            assert len(calls) == 4
            model(torch.randn(1, 17, 32))               # many rows (> 16): F.linear
            assert len(calls) == 4
            with streamed_linears(model):              # nested: a no-op, the outer patch survives
                pass
            model(x)
            assert len(calls) == 6
        model(x)
        assert len(calls) == 6 and "forward" not in model.a.__dict__
        with streamed_linears(model, enabled=False):
            model(x)
        assert len(calls) == 6
    torch.testing.assert_close(streamed, plain, rtol=1e-5, atol=1e-6)


def test_streamed_linears_restores_after_an_error():
    model = TwoLayers()
    with pytest.raises(RuntimeError):
        with streamed_linears(model):
            model(torch.randn(2, 31))  # wrong width
    assert "forward" not in model.a.__dict__ and "forward" not in model.b.__dict__


def test_linear_rows_matches_the_layer():
    layer = nn.Linear(64, 80)
    for rows in (1, 3, 8, 20):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(linear_rows(layer, x), layer(x), rtol=1e-5, atol=1e-5)


def test_streamed_linears_leave_other_dtypes_to_f_linear():
    """float64 (which the op does not take) stays on F.linear: the loop works in any dtype."""
    model = TwoLayers().double()
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    with torch.no_grad():
        plain = model(x)
        with streamed_linears(model):
            torch.testing.assert_close(model(x), plain, rtol=0, atol=0)


def test_stream_rule_matches_the_paths():
    """ops.linear.skinny_linear_streams and hardware.cpu_paths read the one rule of csrc/cpu/isa.h."""
    from dflash_ext.ops import hardware
    w = torch.randn(16, 32)
    avx512 = hardware.ISA_LEVELS.index(hardware.cpu_isa()["active"]) >= hardware.ISA_LEVELS.index("avx512")
    for rows in (1, 8, 9, 16, 17):
        x = torch.randn(rows, 32)
        path = hardware.cpu_paths(torch.float32, rows=rows, weight_bytes=w.numel() * 4)["skinny_linear"]
        assert skinny_linear_streams(x, w) == (path == "stream") == (rows <= (16 if avx512 else 8))
    for rows in (8, 16, 17):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        path = hardware.cpu_paths(torch.bfloat16, rows=rows, weight_bytes=w.numel() * 2)["skinny_linear"]
        assert skinny_linear_streams(x, w.bfloat16()) == (path == "stream")
    assert not skinny_linear_streams(torch.randn(4, 32, dtype=torch.float64), w.double())
    assert not skinny_linear_streams(torch.randn(4, 0), torch.randn(16, 0))
