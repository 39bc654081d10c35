"""Benchmark each fused dflash_ext op against the eager PyTorch composition a user would write.

How to run (from the repository root, with the extension already built)::

    .venv/bin/python bench/bench_ops.py                      # both presets, bf16, 2 threads, CPU
    .venv/bin/python bench/bench_ops.py --quick              # CI smoke test, well under a minute
    .venv/bin/python bench/bench_ops.py --dtype all --threads 8 --batch 1 4
    .venv/bin/python bench/bench_ops.py --presets smollm2 --tokens 1 16 --contexts 4096
    .venv/bin/python bench/bench_ops.py --device cuda         # only if the ops have CUDA kernels

Prints one aligned table per op on stdout (progress goes to stderr) and writes the
same rows plus run metadata as JSON (default ``bench/out/bench_ops.json``).

Shapes (the two DFlash drafters; k = number of target hidden-state features, N = layers):

* ``smollm2``  (SmolLM2-135M drafter): H=576,  Hq=9,  Hkv=3, D=64,  N=5, k=5
* ``qwen3-8b`` (Qwen3-8B drafter):     H=4096, Hq=32, Hkv=8, D=128, N=5, k=5

Baselines (eager PyTorch in the op's dtype, batched, no Python loops over tokens/layers):

* project_features: (a) ``F.rms_norm(F.linear(torch.cat(features, -1), W), (H_out,),
  norm_weight, eps)``; (b) the bare GEMM ``F.linear(cat_x, W)`` on an input concatenated
  outside the timed region (the floor the fused op should reach).
* inject_context_kv: one ``F.linear`` over all N layers' K weights, ``F.rms_norm`` over D,
  times the per-layer norm weight, rotate_half RoPE gathered at ``positions``, one
  ``F.linear`` for V, and two index writes ``k_cache[:, slots] = ...``.
* block_attention: context K/V of each sequence taken as a view of the cache (the sequences
  are laid out back to back, all with the same context length, so eager can batch),
  ``torch.cat`` with the block K/V, ``F.scaled_dot_product_attention(..., enable_gqa=True)``
  and ``transpose(1, 2).contiguous()`` back to ``[Bsz, Bq, Hq, D]`` (as Hugging Face does).

Goals: inject_context_kv and block_attention >= 2x faster than eager for T/Bq <= 16;
project_features no slower than the bare ``F.linear`` (ratio_vs_linear >= 1).

Before timing, every configuration checks that the fused op and the eager composition agree
(``allclose`` with dtype-dependent tolerances); on a mismatch it prints both errors against
the fp32 reference (``dflash_ext.reference``) and aborts with exit status 1.

Timing: ``time.perf_counter`` around each call (CUDA: CUDA events), ``--warmup`` untimed
calls of each variant, then rounds that call fused / eager (/ linear, / sdpa) once each, interleaved,
until ``--repeats`` timed calls or ``--budget`` seconds of timed calls (at least
``--min-repeats``); the median per variant is reported (the minimum goes to the JSON too).
On CPU a tiny multi-threaded canary op brackets every timed call, and calls made while it is
slow (a shared VM whose other vCPU is taken by the host: every parallel region then waits a
4-12 ms scheduler tick) are dropped, and a pass with more than 10% such calls is repeated once
the machine is quiet again; rows still disturbed after ``--max-wait`` seconds are marked ``!``
in the table (``noisy`` in the JSON). ``--no-quiet-check`` turns this off.

CUDA only (``--device cuda``; the CPU tables and JSON do not have these):

* At startup the device copy bandwidth is measured once: the median time (same Timer, CUDA
  events) of ``dst.copy_(src)`` on a ``--copy-mib`` (default 1024 MiB) uint8 buffer, counting
  2 x size bytes (read + write). JSON metadata: ``copy_gbps``, ``copy_ms``, ``copy_bytes``,
  ``copy_repeats`` (and ``sdpa_enable_gqa``).
* Every row gets ``min_bytes`` (JSON only): the fewest bytes the fused op must move, each
  input read once and each output written once (``min_bytes()``): project_features
  fc_weight + norm_weight + features + out; inject_context_kv k/v weights + k_norm_weight +
  ctx + the T rows of cos/sin + positions/slots + the K/V cache rows written;
  block_attention q + out + the K/V of the visible context and of the block + offsets/lens.
  Columns ``fused_gbps`` = min_bytes / fused_ms (GB/s, 1e9) and ``pct_of_copy`` =
  fused_gbps / copy_gbps x 100: how close the op is to streaming its data at copy speed.
  The timed calls repeat on the same buffers, so a working set smaller than the GPU's L2
  cache (tens of MB: the smollm2 shapes, block_attention K/V up to a few thousand rows) may
  be served from L2 and pct_of_copy can then exceed 100%.
* block_attention also times ``F.scaled_dot_product_attention`` alone on the same problem at
  its best case (``sdpa_problem()``): q as ``[Bsz, Hq, Bq, D]``, each sequence's context rows
  followed by its block rows as contiguous ``[Bsz, Hkv, L, D]`` K/V built outside the timed
  region, ``enable_gqa=True`` (K/V expanded to Hq heads if this torch lacks it), not causal,
  same scale; its output is checked against the fused op like the eager one. Columns
  ``sdpa_ms`` and ``ratio_vs_sdpa`` = sdpa_ms / fused_ms (> 1: the fused op is faster).
"""
import argparse
import datetime
import functools
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import DTYPES, OUT_DIR, Timer, cpu_flags, cpu_model, git_info  # noqa: E402

import dflash_ext  # noqa: E402
from dflash_ext import ops, reference  # noqa: E402

PRESETS = {
    "smollm2": dict(H=576, Hq=9, Hkv=3, D=64, N=5, k=5),
    "qwen3-8b": dict(H=4096, Hq=32, Hkv=8, D=128, N=5, k=5),
}
# Loose tolerances: eager rounds intermediates (GEMM output, norm, RoPE) to the dtype,
# the fused ops accumulate in fp32, so low-precision results differ by a few ulps.
TOLS = {torch.float32: (2e-3, 2e-3), torch.bfloat16: (6e-2, 6e-2), torch.float16: (1e-2, 1e-2)}
EPS = 1e-6
ROPE_THETA = 1e6
GOAL_SPEEDUP = 2.0
GOAL_MAX_TOKENS = 16
NOISE = 0.05  # misses within 5% of the goal are flagged as possibly noise


class MismatchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- verification

def check_close(name, fused, eager, ref, dtype, other="eager", other_desc="eager composition"):
    """Abort loudly if the fused op and the eager composition (or `other`) disagree."""
    rtol, atol = TOLS[dtype]
    if torch.allclose(fused.float(), eager.float(), rtol=rtol, atol=atol):
        return
    f, e, r = fused.float(), eager.float(), ref.float()
    msg = (f"{name}: fused op and {other_desc} DISAGREE (rtol={rtol}, atol={atol}): "
           f"max|fused-{other}|={(f - e).abs().max().item():.4g}, "
           f"max|fused-ref32|={(f - r).abs().max().item():.4g}, "
           f"max|{other}-ref32|={(e - r).abs().max().item():.4g}, "
           f"nonfinite fused={int((~torch.isfinite(f)).sum())} {other}={int((~torch.isfinite(e)).sum())}")
    raise MismatchError(msg)


# --------------------------------------------------------------------------- eager compositions

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_project_features(features, fc_weight, norm_weight, eps):
    H_out = fc_weight.shape[0]
    return F.rms_norm(F.linear(torch.cat(features, -1), fc_weight), (H_out,), norm_weight, eps)


def eager_inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots,
                            k_cache, v_cache, eps):
    T, H = ctx.shape
    N, HD, _ = k_weight.shape
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k = F.linear(ctx, k_weight.view(N * HD, H)).view(T, N, Hkv, D)
    k = F.rms_norm(k, (D,), eps=eps) * k_norm_weight[None, :, None, :]
    c = cos[positions][:, None, None, :]
    s = sin[positions][:, None, None, :]
    k = k * c + rotate_half(k) * s
    v = F.linear(ctx, v_weight.view(N * HD, H)).view(T, N, Hkv, D)
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)


def eager_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_len, scale):
    """Sequences' contexts are back to back in the cache with one length: a view gathers them."""
    Bsz, Bq, Hq, D = q.shape
    Hkv = k_block.shape[2]
    k_ctx = k_cache[: Bsz * ctx_len].view(Bsz, ctx_len, Hkv, D)
    v_ctx = v_cache[: Bsz * ctx_len].view(Bsz, ctx_len, Hkv, D)
    k = torch.cat([k_ctx, k_block], dim=1).transpose(1, 2)  # [Bsz, Hkv, L, D]
    v = torch.cat([v_ctx, v_block], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- SDPA and bandwidth (CUDA columns)

@functools.lru_cache(maxsize=None)
def sdpa_supports_gqa():
    """Whether this torch's F.scaled_dot_product_attention takes ``enable_gqa=True``."""
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8),
                                       torch.zeros(1, 1, 1, 8), enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def sdpa_problem(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale, gqa=None):
    """block_attention laid out for SDPA at its best case (build it outside the timed region):
    q as contiguous ``[Bsz, Hq, Bq, D]``; per sequence b its context rows
    ``k_cache[offsets[b]:offsets[b] + lens[b]]`` followed by ``k_block[b]``, as contiguous
    ``[Bsz, Hkv, L, D]`` K and V (L = context + Bq). All sequences need one context length (no
    padding mask). gqa: True passes ``enable_gqa=True``, False expands K/V to Hq heads, None
    picks True when this torch supports it. Returns ``(q, k, v, kwargs)`` for
    ``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (see ``sdpa_block_attention``)."""
    Bsz, Bq, Hq, D = q.shape
    Hkv = k_block.shape[2]
    offs, ns = [int(o) for o in offsets.tolist()], [int(n) for n in lens.tolist()]
    if len(set(ns)) > 1:
        raise ValueError(f"sdpa_problem: all sequences need the same context length, got {ns}")
    k = torch.stack([torch.cat([k_cache[o:o + n], k_block[b]]) for b, (o, n) in enumerate(zip(offs, ns))])
    v = torch.stack([torch.cat([v_cache[o:o + n], v_block[b]]) for b, (o, n) in enumerate(zip(offs, ns))])
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [Bsz, Hkv, L, D]
    kwargs = dict(scale=scale)
    if Hq != Hkv:
        if sdpa_supports_gqa() if gqa is None else gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    return q.transpose(1, 2).contiguous(), k.contiguous(), v.contiguous(), kwargs


def sdpa_block_attention(problem):
    """Non-causal SDPA on an ``sdpa_problem``; the output is ``[Bsz, Hq, Bq, D]`` (the fused op's
    is ``[Bsz, Bq, Hq, D]``: compare with ``.transpose(1, 2)``)."""
    q, k, v, kwargs = problem
    return F.scaled_dot_product_attention(q, k, v, is_causal=False, **kwargs)


IDX_BYTES = 8  # int64 positions / slots / cache offsets / cache lengths


def min_bytes(op, p, itemsize, tokens, context=None, batch=None):
    """The fewest bytes one call of the fused `op` moves: every input element read once and every
    output element written once (itemsize: bytes per element of the op's dtype; p: a PRESETS
    entry). tokens = T (project/inject) or Bq (attention); context and batch: attention only."""
    H, Hq, Hkv, D, N, k = (p[key] for key in ("H", "Hq", "Hkv", "D", "N", "k"))
    if op == "project_features":
        T, H_out = tokens, H  # the drafters project back to the hidden size (bench_project_features)
        elems = H_out * k * H + H_out + T * k * H + T * H_out  # fc_weight, norm_weight, features, out
        return elems * itemsize
    if op == "inject_context_kv":
        T = tokens
        elems = (2 * N * Hkv * D * H + N * D  # k/v weights, k_norm_weight
                 + T * H + 2 * T * D  # ctx, the cos/sin rows at positions
                 + 2 * N * T * Hkv * D)  # the K and V cache rows written
        return elems * itemsize + 2 * T * IDX_BYTES  # positions, slots
    if op == "block_attention":
        Bq, L = tokens, context + tokens  # visible keys: the context then the block
        elems = 2 * batch * Bq * Hq * D + 2 * batch * L * Hkv * D  # q + out, K + V
        return elems * itemsize + 2 * batch * IDX_BYTES  # cache offsets, cache lengths
    raise ValueError(f"min_bytes: unknown op {op!r}")


def add_bandwidth(row, copy_gbps):
    """Add min_bytes, fused_gbps and pct_of_copy to a row tagged with its preset and dtype."""
    nbytes = min_bytes(row["op"], PRESETS[row["preset"]], DTYPES[row["dtype"]].itemsize, row["tokens"],
                       row["context"], row["batch"])
    gbps = nbytes / row["fused_ms"] / 1e6  # bytes / (ms * 1e-3) / 1e9
    row.update(min_bytes=nbytes, fused_gbps=gbps, pct_of_copy=100.0 * gbps / copy_gbps)
    return row


def measure_copy_bandwidth(timer, device, nbytes):
    """Median time of ``dst.copy_(src)`` on `nbytes`-byte uint8 buffers, with `timer`; the
    bandwidth counts 2 x nbytes (read + write). Returns copy_gbps, copy_ms, copy_bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, info = timer.measure(dict(copy=lambda: dst.copy_(src)))
    del src, dst
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return dict(copy_gbps=2 * nbytes / t["copy"] / 1e6, copy_ms=t["copy"], copy_bytes=nbytes,
                copy_repeats=info["repeats"])


# --------------------------------------------------------------------------- benchmarks

def rope_tables(P, D, dtype, device):
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def randn(shape, dtype, device, gen, scale=1.0):
    # Generate in fp32 on CPU (deterministic), scale, then cast and move.
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype).to(device)


def bench_project_features(p, dtype, device, tokens, timer, gen, log):
    H, k = p["H"], p["k"]
    H_out = H
    fc_weight = randn((H_out, k * H), dtype, device, gen, 1.0 / math.sqrt(k * H))
    norm_weight = randn((H_out,), dtype, device, gen, 0.1).add_(1.0)
    rows = []
    for T in tokens:
        features = [randn((T, H), dtype, device, gen) for _ in range(k)]
        cat_x = torch.cat(features, -1)
        fused = ops.project_features(features, fc_weight, norm_weight, EPS)
        eager = eager_project_features(features, fc_weight, norm_weight, EPS)
        ref = reference.project_features(features, fc_weight, norm_weight, EPS)
        check_close(f"project_features[{p['name']}, {dtype}, T={T}]", fused, eager, ref, dtype)
        del fused, eager, ref
        t, info = timer.measure(dict(
            fused=lambda: ops.project_features(features, fc_weight, norm_weight, EPS),
            eager=lambda: eager_project_features(features, fc_weight, norm_weight, EPS),
            linear=lambda: F.linear(cat_x, fc_weight)))
        rows.append(dict(op="project_features", tokens=T, context=None, batch=None, fused_ms=t["fused"],
                         eager_ms=t["eager"], ratio=t["eager"] / t["fused"], linear_ms=t["linear"],
                         ratio_vs_linear=t["linear"] / t["fused"], **info))
        log(rows[-1])
    del fc_weight
    return rows


def bench_inject_context_kv(p, dtype, device, tokens, contexts, timer, gen, log):
    H, Hkv, D, N = p["H"], p["Hkv"], p["D"], p["N"]
    T_max = max(tokens)
    S = max(contexts) + T_max  # one layer cache holds the longest context plus the new tokens
    P = S
    k_weight = randn((N, Hkv * D, H), dtype, device, gen, 1.0 / math.sqrt(H))
    v_weight = randn((N, Hkv * D, H), dtype, device, gen, 1.0 / math.sqrt(H))
    k_norm_weight = randn((N, D), dtype, device, gen, 0.1).add_(1.0)
    cos, sin = rope_tables(P, D, dtype, device)
    k_fused = torch.zeros((N, S, Hkv, D), dtype=dtype, device=device)
    v_fused = torch.zeros_like(k_fused)
    k_eager = torch.zeros_like(k_fused)
    v_eager = torch.zeros_like(k_fused)
    rows = []
    for T in tokens:
        ctx = randn((T, H), dtype, device, gen)
        start = min(contexts)  # the new tokens follow a context of this length
        positions = torch.arange(start, start + T, dtype=torch.int64, device=device)
        slots = positions.clone()
        args_f = (ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots, k_fused, v_fused, EPS)
        args_e = (ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots, k_eager, v_eager, EPS)
        k_fused.zero_(); v_fused.zero_(); k_eager.zero_(); v_eager.zero_()
        ops.inject_context_kv(*args_f)
        eager_inject_context_kv(*args_e)
        k_ref, v_ref = torch.zeros_like(k_fused), torch.zeros_like(v_fused)
        reference.inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, cos, sin, positions, slots,
                                    k_ref, v_ref, EPS)
        name = f"inject_context_kv[{p['name']}, {dtype}, T={T}]"
        # Whole caches: the rows at `slots` must agree and every other row must stay zero.
        check_close(name + " k_cache", k_fused, k_eager, k_ref, dtype)
        check_close(name + " v_cache", v_fused, v_eager, v_ref, dtype)
        del k_ref, v_ref
        # Every call rewrites the same rows: in-place repeats are idempotent.
        t, info = timer.measure(dict(fused=lambda: ops.inject_context_kv(*args_f),
                                     eager=lambda: eager_inject_context_kv(*args_e)))
        rows.append(dict(op="inject_context_kv", tokens=T, context=None, batch=None, fused_ms=t["fused"],
                         eager_ms=t["eager"], ratio=t["eager"] / t["fused"], **info))
        log(rows[-1])
    return rows


def bench_block_attention(p, dtype, device, tokens, contexts, batches, timer, gen, log, sdpa=False):
    """sdpa: also time F.scaled_dot_product_attention alone on `sdpa_problem` (CUDA columns)."""
    Hq, Hkv, D = p["Hq"], p["Hkv"], p["D"]
    scale = 1.0 / math.sqrt(D)
    rows = []
    for bsz in batches:
        for ctx_len in contexts:
            S = bsz * ctx_len
            k_cache = randn((S, Hkv, D), dtype, device, gen)
            v_cache = randn((S, Hkv, D), dtype, device, gen)
            offsets = torch.arange(bsz, dtype=torch.int64, device=device) * ctx_len
            lens = torch.full((bsz,), ctx_len, dtype=torch.int64, device=device)
            for Bq in tokens:
                q = randn((bsz, Bq, Hq, D), dtype, device, gen)
                k_block = randn((bsz, Bq, Hkv, D), dtype, device, gen)
                v_block = randn((bsz, Bq, Hkv, D), dtype, device, gen)
                fused = ops.block_attention(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale)
                eager = eager_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_len, scale)
                ref = reference.block_attention(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale)
                name = f"block_attention[{p['name']}, {dtype}, Bsz={bsz}, Bq={Bq}, ctx={ctx_len}]"
                check_close(name, fused, eager, ref, dtype)
                fns = dict(
                    fused=lambda: ops.block_attention(q, k_block, v_block, k_cache, v_cache, offsets, lens,
                                                      scale),
                    eager=lambda: eager_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_len,
                                                        scale))
                if sdpa:
                    problem = sdpa_problem(q, k_block, v_block, k_cache, v_cache, offsets, lens, scale)
                    check_close(name, fused, sdpa_block_attention(problem).transpose(1, 2), ref, dtype,
                                other="sdpa", other_desc="F.scaled_dot_product_attention")
                    fns["sdpa"] = lambda: sdpa_block_attention(problem)
                del fused, eager, ref
                t, info = timer.measure(fns)
                extra = dict(sdpa_ms=t["sdpa"], ratio_vs_sdpa=t["sdpa"] / t["fused"]) if sdpa else {}
                rows.append(dict(op="block_attention", tokens=Bq, context=ctx_len, batch=bsz,
                                 fused_ms=t["fused"], eager_ms=t["eager"], ratio=t["eager"] / t["fused"],
                                 **extra, **info))
                log(rows[-1])
    return rows


# --------------------------------------------------------------------------- goals and output

def goal_status(row):
    """'ok', 'MISS', 'miss~' (within NOISE of the goal) or '-' (no goal at this size)."""
    if row["op"] == "project_features":
        value, target = row["ratio_vs_linear"], 1.0
    elif row["tokens"] <= GOAL_MAX_TOKENS:
        value, target = row["ratio"], GOAL_SPEEDUP
    else:
        return "-"
    if value >= target:
        return "ok"
    return "miss~" if value >= target * (1 - NOISE) else "MISS"


OP_ORDER = ["project_features", "inject_context_kv", "block_attention"]
GOAL_TEXT = {
    "project_features": "goal: fused_ms <= bare F.linear on pre-concatenated input "
                        "(ratio_vs_linear >= 1); ratio = eager/fused",
    "inject_context_kv": f"goal: ratio (eager/fused) >= {GOAL_SPEEDUP:g}x for T <= {GOAL_MAX_TOKENS}",
    "block_attention": f"goal: ratio (eager/fused) >= {GOAL_SPEEDUP:g}x for Bq <= {GOAL_MAX_TOKENS}",
}


def format_table(op, rows):
    cols = [("preset", "preset", "{}"), ("dtype", "dtype", "{}"),
            ("tokens", "Bq" if op == "block_attention" else "T", "{}")]
    if op == "block_attention":
        cols += [("batch", "batch", "{}"), ("context", "context", "{}")]
    cols += [("fused_ms", "fused_ms", "{:.4f}"), ("eager_ms", "eager_ms", "{:.4f}"),
             ("ratio", "ratio", "{:.2f}x")]
    if op == "project_features":
        cols += [("linear_ms", "linear_ms", "{:.4f}"), ("ratio_vs_linear", "ratio_vs_linear", "{:.2f}x")]
    if any("sdpa_ms" in r for r in rows):  # CUDA columns
        cols += [("sdpa_ms", "sdpa_ms", "{:.4f}"), ("ratio_vs_sdpa", "ratio_vs_sdpa", "{:.2f}x")]
    if any("fused_gbps" in r for r in rows):
        cols += [("fused_gbps", "fused_gbps", "{:.1f}"), ("pct_of_copy", "pct_of_copy", "{:.1f}%")]
    cols += [("goal", "goal", "{}"),
             ("repeats", "n", lambda r: f"{r['repeats']}" + ("!" if r["noisy"] else ""))]
    return _common.format_table(rows, cols, title=f"== {op} ({GOAL_TEXT[op]})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=None,
                    help="float32, bfloat16, float16 (several allowed) or 'all' (default: bfloat16)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=None,
                    help="drafter shapes (default: both)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="T for project/inject and Bq for attention (default 1 4 8 16 32)")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help="context lengths for block_attention (default 512 4096)")
    ap.add_argument("--batch", nargs="+", type=int, default=None,
                    help="sequences per block_attention call (default 1; e.g. --batch 1 4)")
    ap.add_argument("--ops", nargs="+", choices=OP_ORDER, default=OP_ORDER, help="ops to run (default all)")
    ap.add_argument("--repeats", type=int, default=None, help="max timed calls per measurement (default 200; --quick 10)")
    ap.add_argument("--min-repeats", type=int, default=None, help="min timed calls (default 5; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of kept timed calls (all variants together) after which a "
                         "measurement stops once --min-repeats "
                         "calls are done (default 1.5; --quick 0.15)")
    ap.add_argument("--no-quiet-check", action="store_true",
                    help="CPU: do not drop calls made while a multi-threaded canary op is slow "
                         "(host contention on a shared VM); see Timer")
    ap.add_argument("--max-wait", type=float, default=None,
                    help="seconds one measurement may wait for a quiet machine before it keeps "
                         "the quiet calls of all its passes and flags the row noisy (default 20; --quick 2)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: T/Bq in {1, 16}, context 512, few repeats (< 1 min)")
    ap.add_argument("--json", default=os.path.join(OUT_DIR, "bench_ops.json"),
                    help="where to write the JSON results (default bench/out/bench_ops.json)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    ap.add_argument("--copy-mib", type=float, default=1024,
                    help="CUDA: size of the buffer whose copy measures the device bandwidth "
                         "(default 1024 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    quick = args.quick
    def pick(value, default, quick_default):
        return value if value is not None else (quick_default if quick else default)
    args.presets = pick(args.presets, list(PRESETS), list(PRESETS))
    args.tokens = pick(args.tokens, [1, 4, 8, 16, 32], [1, 16])
    args.contexts = pick(args.contexts, [512, 4096], [512])
    args.batch = pick(args.batch, [1], [1])
    args.repeats = pick(args.repeats, 200, 10)
    args.min_repeats = pick(args.min_repeats, 5, 3)
    args.warmup = pick(args.warmup, 3, 3)
    args.budget = pick(args.budget, 1.5, 0.15)
    args.max_wait = pick(args.max_wait, 20.0, 2.0)
    names = args.dtype or ["bfloat16"]
    if "all" in names:
        names = list(DTYPES)
    bad = [n for n in names if n not in DTYPES]
    if bad:
        ap.error(f"unknown --dtype {bad}; choose from {list(DTYPES)} or 'all'")
    args.dtype = list(dict.fromkeys(names))
    if any(t < 1 for t in args.tokens) or any(c < 0 for c in args.contexts) or any(b < 1 for b in args.batch):
        ap.error("--tokens and --batch must be >= 1, --contexts >= 0")
    if args.copy_mib <= 0:
        ap.error("--copy-mib must be > 0")
    args.min_repeats = max(1, min(args.min_repeats, args.repeats))
    return args


def main(argv=None, extras=None):
    """extras: add the CUDA columns (copy bandwidth, fused_gbps / pct_of_copy, SDPA); None: on
    CUDA only. The tests force them on CPU to exercise that code without a GPU."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if extras is None:
        extras = device.type == "cuda"
    missing = _common.check_device(device, args.ops, prog="bench_ops")
    if missing:
        sys.exit(f"bench_ops: dflash_ext has no CUDA kernel for {missing}; run on --device cpu")
    torch.set_num_threads(args.threads)
    timer = Timer(device, args.warmup, args.repeats, args.min_repeats, args.budget,
                  quiet_check=not args.no_quiet_check, max_wait=args.max_wait)
    commit, dirty = git_info()
    meta = dict(
        torch_version=torch.__version__, dflash_ext_version=getattr(dflash_ext, "__version__", None),
        dtypes=args.dtype, threads=torch.get_num_threads(), device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()),
        cpu_model=cpu_model(), cpu_flags=cpu_flags(), cpu_count=os.cpu_count(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit, git_dirty=dirty, python=platform.python_version(),
        presets={name: PRESETS[name] for name in args.presets}, tokens=args.tokens,
        contexts=args.contexts, batch=args.batch, warmup=args.warmup, repeats=args.repeats,
        min_repeats=args.min_repeats, budget_s=args.budget, quick=args.quick, eps=EPS,
        quiet_check=timer.quiet_check, max_wait_s=args.max_wait,
        canary_limit_ms=(round(timer.canary_limit_ms, 4) if timer.quiet_check else None),
        goals=dict(inject_context_kv=f"ratio >= {GOAL_SPEEDUP} for T <= {GOAL_MAX_TOKENS}",
                   block_attention=f"ratio >= {GOAL_SPEEDUP} for Bq <= {GOAL_MAX_TOKENS}",
                   project_features="fused_ms <= linear_ms (ratio_vs_linear >= 1)"),
        tolerances={str(d).replace("torch.", ""): dict(rtol=r, atol=a) for d, (r, a) in TOLS.items()},
    )
    print(f"bench_ops: torch {torch.__version__}, device {device} ({meta['device_name']}), "
          f"threads {meta['threads']}, dtypes {args.dtype}, presets {args.presets}, git {commit}"
          f"{'+dirty' if dirty else ''}", file=sys.stderr)
    copy = None
    if extras:
        copy = measure_copy_bandwidth(timer, device, int(args.copy_mib * (1 << 20)))
        meta.update(copy, sdpa_enable_gqa=sdpa_supports_gqa())
        print(f"bench_ops: copy bandwidth {copy['copy_gbps']:.1f} GB/s (median {copy['copy_ms']:.4f} ms "
              f"over {copy['copy_repeats']} copies of {copy['copy_bytes'] / (1 << 20):g} MiB, read + write "
              f"counted)", file=sys.stderr)

    rows = []
    t_start = time.perf_counter()

    def log(row):
        extra = (f" linear {row['linear_ms']:.4f} ms ({row['ratio_vs_linear']:.2f}x)"
                 if "linear_ms" in row else "")
        if "sdpa_ms" in row:
            extra += f" sdpa {row['sdpa_ms']:.4f} ms ({row['ratio_vs_sdpa']:.2f}x)"
        if "fused_gbps" in row:
            extra += f" fused {row['fused_gbps']:.1f} GB/s ({row['pct_of_copy']:.1f}% of copy)"
        where = f" ctx={row['context']} bsz={row['batch']}" if row["context"] is not None else ""
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {row['op']:<17} {row['preset']:<8} "
              f"{row['dtype']:<8} T={row['tokens']:<3}{where}: fused {row['fused_ms']:.4f} ms, "
              f"eager {row['eager_ms']:.4f} ms ({row['ratio']:.2f}x){extra} n={row['repeats']}"
              f" dropped={row['dropped']} passes={row['passes']}{' NOISY' if row['noisy'] else ''}",
              file=sys.stderr, flush=True)

    try:
        for preset in args.presets:
            p = dict(PRESETS[preset], name=preset)
            for dname in args.dtype:
                dtype = DTYPES[dname]
                gen = torch.Generator().manual_seed(args.seed)
                tag = dict(preset=preset, dtype=dname)

                def tagged_log(row, tag=tag):
                    row.update(tag)
                    if copy is not None:
                        add_bandwidth(row, copy["copy_gbps"])
                    log(row)
                for op in args.ops:
                    if op == "project_features":
                        new = bench_project_features(p, dtype, device, args.tokens, timer, gen, tagged_log)
                    elif op == "inject_context_kv":
                        new = bench_inject_context_kv(p, dtype, device, args.tokens, args.contexts, timer,
                                                      gen, tagged_log)
                    else:
                        new = bench_block_attention(p, dtype, device, args.tokens, args.contexts, args.batch,
                                                    timer, gen, tagged_log, sdpa=extras)
                    rows += new
    except MismatchError as e:
        print("\n" + "!" * 78 + f"\nBUG: {e}\n" + "!" * 78, file=sys.stderr)
        print(f"BUG: {e}")
        return 1

    key_order = ["op", "preset", "dtype", "tokens", "context", "batch", "fused_ms", "eager_ms", "ratio",
                 "linear_ms", "ratio_vs_linear", "sdpa_ms", "ratio_vs_sdpa", "min_bytes", "fused_gbps",
                 "pct_of_copy", "goal", "repeats", "dropped", "passes", "noisy", "fused_min_ms",
                 "eager_min_ms", "linear_min_ms", "sdpa_min_ms"]
    for r in rows:
        r["goal"] = goal_status(r)
    rows = [{k: r[k] for k in key_order if k in r} for r in rows]

    print(f"# dflash_ext fused ops vs eager PyTorch | device {device} ({meta['device_name']}) | "
          f"threads {meta['threads']} | torch {torch.__version__} | git {commit}{'+dirty' if dirty else ''}")
    print(f"# Goals: inject_context_kv and block_attention >= {GOAL_SPEEDUP:g}x faster than eager for "
          f"T/Bq <= {GOAL_MAX_TOKENS}; project_features no slower than bare F.linear on a "
          f"pre-concatenated input. Times are medians in ms; ratio = eager_ms / fused_ms; "
          f"ratio_vs_linear = linear_ms / fused_ms.")
    if copy is not None:
        print(f"# Copy bandwidth {copy['copy_gbps']:.1f} GB/s (median dst.copy_(src) of "
              f"{copy['copy_bytes'] / (1 << 20):g} MiB, read + write counted). fused_gbps = fewest bytes the "
              f"op must move (weights + activations + outputs) / fused_ms; pct_of_copy = fused_gbps / copy "
              f"bandwidth. sdpa_ms = F.scaled_dot_product_attention alone on pre-concatenated contiguous "
              f"K/V; ratio_vs_sdpa = sdpa_ms / fused_ms.")
    for op in OP_ORDER:
        op_rows = [r for r in rows if r["op"] == op]
        if op_rows:
            print()
            print(format_table(op, op_rows))
    misses = [r for r in rows if r["goal"] in ("MISS", "miss~")]
    print()
    if misses:
        print(f"# Goal not met in {len(misses)} row(s) ('miss~' = within {NOISE:.0%} of the goal):")
        for r in misses:
            what = (f"ratio_vs_linear {r['ratio_vs_linear']:.2f}x" if r["op"] == "project_features"
                    else f"ratio {r['ratio']:.2f}x")
            ctx = f" context={r['context']} batch={r['batch']}" if r["context"] is not None else ""
            print(f"#   {r['op']} {r['preset']} {r['dtype']} T/Bq={r['tokens']}{ctx}: {what} [{r['goal']}]")
    else:
        print("# All goals met.")
    noisy = [r for r in rows if r["noisy"]]
    if noisy:
        print(f"# WARNING: {len(noisy)} row(s) marked '!' were measured while the machine stayed busy "
              f"(no quiet pass within --max-wait); treat them as unreliable.")
    if timer.quiet_check:
        print(f"# quiet check: dropped {timer.dropped_calls} timed call(s) made while the machine was busy, "
              f"repeated {timer.retried_passes} measurement pass(es), waited {timer.waited_s:.1f} s "
              f"for a quiet machine")
    print(f"# total {time.perf_counter() - t_start:.1f} s")

    meta["elapsed_s"] = round(time.perf_counter() - t_start, 2)
    summary = timer.summary()
    meta.update({k: summary[k] for k in ("quiet_wait_s", "dropped_calls", "retried_passes")})
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows))
        print(f"# JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
