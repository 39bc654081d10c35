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
calls of each variant, then rounds that call fused / eager (/ linear) once each, interleaved,
until ``--repeats`` timed calls or ``--budget`` seconds of timed calls (at least
``--min-repeats``); the median per variant is reported (the minimum goes to the JSON too).
On CPU a tiny multi-threaded canary op brackets every timed call, and calls made while it is
slow (a shared VM whose other vCPU is taken by the host: every parallel region then waits a
4-12 ms scheduler tick) are dropped, and a pass with more than 10% such calls is repeated once
the machine is quiet again; rows still disturbed after ``--max-wait`` seconds are marked ``!``
in the table (``noisy`` in the JSON). ``--no-quiet-check`` turns this off.
"""
import argparse
import datetime
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

def check_close(name, fused, eager, ref, dtype):
    """Abort loudly if the fused op and the eager composition disagree."""
    rtol, atol = TOLS[dtype]
    if torch.allclose(fused.float(), eager.float(), rtol=rtol, atol=atol):
        return
    f, e, r = fused.float(), eager.float(), ref.float()
    msg = (f"{name}: fused op and eager composition DISAGREE (rtol={rtol}, atol={atol}): "
           f"max|fused-eager|={(f - e).abs().max().item():.4g}, "
           f"max|fused-ref32|={(f - r).abs().max().item():.4g}, "
           f"max|eager-ref32|={(e - r).abs().max().item():.4g}, "
           f"nonfinite fused={int((~torch.isfinite(f)).sum())} eager={int((~torch.isfinite(e)).sum())}")
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


def bench_block_attention(p, dtype, device, tokens, contexts, batches, timer, gen, log):
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
                check_close(f"block_attention[{p['name']}, {dtype}, Bsz={bsz}, Bq={Bq}, ctx={ctx_len}]",
                            fused, eager, ref, dtype)
                del fused, eager, ref
                t, info = timer.measure(dict(
                    fused=lambda: ops.block_attention(q, k_block, v_block, k_cache, v_cache, offsets, lens,
                                                      scale),
                    eager=lambda: eager_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_len,
                                                        scale)))
                rows.append(dict(op="block_attention", tokens=Bq, context=ctx_len, batch=bsz,
                                 fused_ms=t["fused"], eager_ms=t["eager"], ratio=t["eager"] / t["fused"],
                                 **info))
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
    args.min_repeats = max(1, min(args.min_repeats, args.repeats))
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
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

    rows = []
    t_start = time.perf_counter()

    def log(row):
        extra = (f" linear {row['linear_ms']:.4f} ms ({row['ratio_vs_linear']:.2f}x)"
                 if "linear_ms" in row else "")
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
                    log(row)
                for op in args.ops:
                    if op == "project_features":
                        new = bench_project_features(p, dtype, device, args.tokens, timer, gen, tagged_log)
                    elif op == "inject_context_kv":
                        new = bench_inject_context_kv(p, dtype, device, args.tokens, args.contexts, timer,
                                                      gen, tagged_log)
                    else:
                        new = bench_block_attention(p, dtype, device, args.tokens, args.contexts, args.batch,
                                                    timer, gen, tagged_log)
                    rows += new
    except MismatchError as e:
        print("\n" + "!" * 78 + f"\nBUG: {e}\n" + "!" * 78, file=sys.stderr)
        print(f"BUG: {e}")
        return 1

    key_order = ["op", "preset", "dtype", "tokens", "context", "batch", "fused_ms", "eager_ms", "ratio",
                 "linear_ms", "ratio_vs_linear", "goal", "repeats", "dropped", "passes", "noisy",
                 "fused_min_ms",
                 "eager_min_ms", "linear_min_ms"]
    for r in rows:
        r["goal"] = goal_status(r)
    rows = [{k: r[k] for k in key_order if k in r} for r in rows]

    print(f"# dflash_ext fused ops vs eager PyTorch | device {device} ({meta['device_name']}) | "
          f"threads {meta['threads']} | torch {torch.__version__} | git {commit}{'+dirty' if dirty else ''}")
    print(f"# Goals: inject_context_kv and block_attention >= {GOAL_SPEEDUP:g}x faster than eager for "
          f"T/Bq <= {GOAL_MAX_TOKENS}; project_features no slower than bare F.linear on a "
          f"pre-concatenated input. Times are medians in ms; ratio = eager_ms / fused_ms; "
          f"ratio_vs_linear = linear_ms / fused_ms.")
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
