"""skinny_linear against reference.skinny_linear (F.linear in fp32), and the decoding
loop's use of it (streamed_linears)."""
import pytest
import torch
from torch import nn

import dflash_ext
from dflash_ext import reference, streamed_linears
from dflash_ext.ops.linear import linear_rows, skinny_linear_streams
from dflash_ext.testing.inputs import make_linear_inputs

from python_tests.helpers import DEVICES, DTYPES, check_op


# Rows 1..8 stream on the CPU, 9 and 300 go to the library; K = 1536 / 576 are the
# SmolLM2 MLP and hidden widths, 33 and 7 leave a remainder after the 16-float steps.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 300]
SHAPES = [(576, 576), (200, 1536), (49, 33), (3, 7)]


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
            model(torch.randn(1, 9, 32))                # many rows (> 8): F.linear
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
    from dflash_ext import hardware
    w = torch.randn(16, 32)
    for rows in (1, 8, 9):
        x = torch.randn(rows, 32)
        path = hardware.cpu_paths(torch.float32, rows=rows, weight_bytes=w.numel() * 4)["skinny_linear"]
        assert skinny_linear_streams(x, w) == (path == "stream") == (rows <= 8)
    assert not skinny_linear_streams(torch.randn(4, 32, dtype=torch.float64), w.double())
    assert not skinny_linear_streams(torch.randn(4, 0), torch.randn(16, 0))
