"""Which kernel runs each linear layer: every such decision of the Python side, in one place.

A linear layer over few rows (the draft block, a verify pass of B tokens, one-token
decoding) runs either ``ops.skinny_linear``'s streaming kernel or the library's
``F.linear``. The CPU kernels' own rule for when the streaming kernel runs is
csrc/cpu/isa.h's, asked through :func:`~dflash_ext.ops.hardware.skinny_linear_path`; here:

- :func:`skinny_linear_streams`: whether that rule streams a given call;
- :func:`streamed_linear`: ``F.linear`` through ``ops.skinny_linear`` where it streams (the
  fused draft layers' GEMMs);
- :func:`lm_head_linear`: the draft step's LM head over its few prediction slots: streamed,
  or ``F.linear`` with its rows padded to a multiple of 16 where this machine runs that faster
  (measured once per shape);
- :func:`linear_rows` / :func:`streamed_linears`: every ``nn.Linear`` of a model as
  :func:`streamed_linear` (the target's verify pass and one-token passes).
"""
import contextlib
import functools
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from . import hardware

__all__ = ["skinny_linear_streams", "streamed_linear", "lm_head_linear", "linear_rows", "streamed_linears"]


def skinny_linear_streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``ops.skinny_linear(x, weight)`` runs its streaming kernel rather than the
    library's linear (the rule is the kernels', ``csrc/cpu/isa.h``: 1..16 bf16 rows on bf16 units,
    else 1..8 rows where the GEMM rule says tiles); False off the CPU and for dtypes
    the op does not take (float64)."""
    if x.device.type != "cpu" or x.dtype not in hardware.CPU_KERNEL_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        return False
    rows = x.numel() // x.shape[-1]
    return hardware.skinny_linear_path(x.dtype, rows, weight.numel() * weight.element_size()) == "stream"


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through ``ops.skinny_linear`` where its streaming kernel runs
    (one pass over the weight: on the CPUs measured the library's GEMM costs about twice its
    one-row GEMV at 2..8 rows, and its GEMV runs below the memory bandwidth on some:
    bench/results/history/notebook-2026.md §6); many rows (a prefill), other devices and a
    call that wants gradients (the op has no backward: training keeps working) stay on F.linear."""
    if skinny_linear_streams(x, weight) and not ops.wants_grad(x, weight, bias):
        return ops.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def lm_head_linear(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` for an LM head over a few rows ``[M, H]`` (the draft
    slots): ``ops.skinny_linear`` where it streams; else F.linear, on the CPU over rows padded
    up to a multiple of 16 where :func:`lm_head_padding` measured that faster."""
    if skinny_linear_streams(rows, weight):
        return ops.skinny_linear(rows, weight, bias)
    pad = lm_head_padding(rows.shape[0], weight, bias)
    if not pad:
        return F.linear(rows, weight, bias)
    return F.linear(F.pad(rows, (0, 0, 0, pad)), weight, bias)[:rows.shape[0]]


_PADDING = {}  # (rows, weight shape, dtype, bias?) -> rows to add


def lm_head_padding(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """Rows to pad an LM-head GEMM of `rows` rows with on the CPU: 0 or up to a multiple of 16,
    whichever this machine runs faster (timed once per shape, then remembered): CPU GEMM
    kernels run some row counts slower than the next multiple of 16 and others faster, by
    library, dtype and CPU (bench/results/history/notebook-2026.md §2). 0 off the CPU."""
    pad = -rows % 16
    if weight.device.type != "cpu" or pad == 0:
        return 0
    key = (rows, tuple(weight.shape), weight.dtype, bias is not None)
    if key not in _PADDING:
        plain, padded = (torch.randn(m, weight.shape[1], dtype=weight.dtype) for m in (rows, rows + pad))
        best = {0: float("inf"), pad: float("inf")}
        with torch.no_grad():
            for _ in range(8):  # interleaved, the minimum of each: robust to other work on the cores
                for p, x in ((0, plain), (pad, padded)):
                    t = time.perf_counter()
                    F.linear(x, weight, bias)
                    best[p] = min(best[p], time.perf_counter() - t)
        _PADDING[key] = min(best, key=best.get)
    return _PADDING[key]


def linear_rows(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` as :func:`streamed_linear`."""
    return streamed_linear(x, layer.weight, layer.bias)


@contextlib.contextmanager
def streamed_linears(*models: nn.Module, enabled: bool = True):
    """Within: every `nn.Linear` of `models` runs as :func:`linear_rows` (the verify pass
    over B tokens, one-token passes). Layers that already carry their own forward (another
    patch, a hook library) are left alone; all are restored on exit. Layers off the CPU are
    left alone too: the op streams on the CPU only (:func:`skinny_linear_streams`), and a
    compiled CUDA pass traces F.linear in one graph instead of breaking at the CPU kernel's
    path query."""
    patched = []
    try:
        for model in models if enabled else ():
            for m in model.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__ and m.weight.device.type == "cpu":
                    m.forward = functools.partial(linear_rows, m)
                    patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
