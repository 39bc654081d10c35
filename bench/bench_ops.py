"""Benchmark each fused dflash_ext op against the plain PyTorch a user would write.

    .venv/bin/python -m bench.bench_ops                 # both presets, bf16 and fp32, 2 threads, CPU
    .venv/bin/python -m bench.bench_ops --quick         # smoke test
    .venv/bin/python -m bench.bench_ops --isa all       # every CPU path this machine can run
    .venv/bin/python -m bench.bench_ops --presets smollm2 --tokens 1 16 --contexts 4096 --batch 1 4
    .venv/bin/python -m bench.bench_ops --device cuda
    .venv/bin/python -m bench.bench_ops --ops block_conv --dtype all --presets smollm2 --conv-hidden 576 2048 4096

Prints the CPU model and ISA level found, then a table per op whose rows name the ISA level
the CPU kernels ran at (``isa``; ``--isa`` forces levels with hardware.forced_cpu_isa) and
the path each op took (``path``, hardware.cpu_paths); JSON: rows and metadata (``--json``).
Shapes: the ``smollm2`` and ``qwen3-8b`` drafters (PRESETS). Baselines, in the op's dtype:
bench/baselines.py's eager_* (skinny_linear: F.linear on the target's layer shapes; ratio =
eager_ms / fused_ms) and, for project_features,
eager_bare_linear on the features concatenated beforehand (ratio_vs_linear = linear_ms /
fused_ms); block_conv (DFlash2, docs/dflash2.md: T = 2 taps, groups of 16 channels, B slots
per block, M = --batch blocks, H = the preset's or --conv-hidden) against eager_block_conv
and reference.block_conv (fp32 math, the specification; ratio_vs_reference = reference_ms /
fused_ms). Each configuration is checked (fused vs eager, allclose; errors against the fp32
reference) before it is timed; a mismatch exits with status 1. Goals: GOALS. Timing: medians
of torch.utils.benchmark's adaptive_autorange (_common.measure); '!' marks a spread (IQR /
median) >= 10%. CUDA only: copy bandwidth (``--copy-mib``), fused_gbps = min_bytes() / fused
time, pct_of_copy of the copy bandwidth, and for block_attention F.scaled_dot_product_attention
alone on K/V made contiguous beforehand (baselines.sdpa_problem): sdpa_ms, ratio_vs_sdpa.
"""
import contextlib
import inspect
import itertools
import math
import sys

import torch
import torch.nn.functional as F

from bench import _common
from bench._common import DTYPES, MismatchError

from bench.baselines import (eager_bare_linear, eager_block_attention, eager_block_conv, eager_inject_context_kv,
                             eager_project_features, sdpa_block_attention, sdpa_problem, sdpa_supports_gqa)
from dflash_ext import ops
from dflash_ext.ops import hardware, reference
from dflash_ext.testing.inputs import randn

PRESETS = {name: dict(H=p["hidden_size"], Hq=p["num_attention_heads"], Hkv=p["num_key_value_heads"], D=p["head_dim"],
                      N=p["num_hidden_layers"], k=p["k"], I=p["intermediate_size"], V=p["vocab_size"])
           for name, p in _common.DRAFTERS.items()}
OPS = ["project_features", "inject_context_kv", "block_attention", "skinny_linear", "block_conv"]
DEFAULT_OPS = OPS[:4]  # DFlash's; block_conv (DFlash2's, its own shapes) runs when named in --ops
ISA_LEVELS = list(getattr(hardware, "ISA_LEVELS", ["avx2", "avx512", "avx512_bf16", "amx_bf16"]))
# Eager rounds intermediates to the dtype, the fused ops accumulate in fp32.
TOLS = {torch.float32: (2e-3, 2e-3), torch.bfloat16: (6e-2, 6e-2), torch.float16: (1e-2, 1e-2)}
EPS, ROPE_THETA, NOISE = 1e-6, 1e6, 0.05  # NOISE: misses within 5% of the goal print as 'miss~'
GOALS = {  # op: (row key, target, where it applies, text)
    "project_features": ("ratio_vs_linear", 1.0, lambda r: r["tokens"] in (1, 4, 16, 32),
                         "ratio_vs_linear (bare F.linear on pre-concatenated input / fused) >= 1 "
                         "at T in {1, 4, 16, 32}"),
    "inject_context_kv": ("ratio", 2.0, lambda r: r["tokens"] <= 16, "ratio (eager/fused) >= 2x at T <= 16"),
    "block_attention": ("ratio", 2.0, lambda r: r["tokens"] <= 16 and 512 <= r["context"] <= 4096,
                        "ratio (eager/fused) >= 2x at Bq <= 16, context 512..4096"),
    "skinny_linear": ("ratio", 1.0, lambda r: r["tokens"] <= 8, "ratio (F.linear/fused) >= 1 at T <= 8"),
    "block_conv": ("ratio", 2.0, lambda r: True, "ratio (eager/fused) >= 2x"),
}
CONV_TAPS, CONV_GROUP = 2, 16  # DFlash2's conv_kernel_size and conv_group_size (docs/dflash2.md)
LM_HEAD_MAX_ELEMENTS = 64 << 20  # skinny_linear times the LM head of the smaller preset only (Qwen3's: 2.5 GB fp32)


def check_close(name, fused, other, ref, dtype, other_name="eager"):
    """Raise MismatchError unless the fused result and `other` agree within TOLS[dtype]."""
    rtol, atol = TOLS[dtype]
    f, e, r = fused.float(), other.float(), ref.float()
    if not torch.allclose(f, e, rtol=rtol, atol=atol):
        raise MismatchError(f"{name}: fused op and {other_name} DISAGREE (rtol={rtol}, atol={atol}): "
                            f"max|fused-{other_name}|={(f - e).abs().max().item():.4g}, max|fused-ref32|="
                            f"{(f - r).abs().max().item():.4g}, "
                            f"max|{other_name}-ref32|={(e - r).abs().max().item():.4g}")


def min_bytes(op, p, itemsize, tokens, context=None, batch=None, weight_shape=None, conv_shape=None):
    """The fewest bytes one call of the fused `op` moves: every input element read once and every
    output element written once (p: a PRESETS entry; tokens = T or Bq; context, batch: attention;
    weight_shape: skinny_linear; conv_shape: block_conv's (M, B, H, T, G))."""
    H, Hq, Hkv, D, N, k = (p[key] for key in ("H", "Hq", "Hkv", "D", "N", "k"))
    if op == "project_features":  # fc_weight, norm_weight, features, out (H_out = H)
        return (H * k * H + H + tokens * k * H + tokens * H) * itemsize
    if op == "inject_context_kv":  # k/v weights, k_norm_weight, ctx, cos/sin rows, K/V rows written
        elems = 2 * N * Hkv * D * H + N * D + tokens * H + 2 * tokens * D + 2 * N * tokens * Hkv * D
        return elems * itemsize + 2 * tokens * 8  # int64 positions, slots
    if op == "block_attention":  # q + out, K + V of context and block; int64 offsets, lengths
        return (2 * batch * tokens * Hq * D + 2 * batch * (context + tokens) * Hkv * D) * itemsize + 2 * batch * 8
    if op == "skinny_linear":  # weight [n_out, n_in], x, out
        n_out, n_in = weight_shape
        return (n_out * n_in + tokens * (n_in + n_out)) * itemsize
    if op == "block_conv":  # x, out, base, delta
        M, B, H, T, G = conv_shape
        return (2 * M * B * H + T * H + M * B * T * G) * itemsize
    raise ValueError(f"min_bytes: unknown op {op!r}")


def add_bandwidth(row, copy_gbps):
    """Add min_bytes, fused_gbps and pct_of_copy to a row tagged with its preset and dtype."""
    nbytes = min_bytes(row["op"], PRESETS[row["preset"]], DTYPES[row["dtype"]].itemsize, row["tokens"],
                       row["context"], row["batch"], row.get("weight_shape"), row.get("conv_shape"))
    gbps = nbytes / row["fused_ms"] / 1e6
    row.update(min_bytes=nbytes, fused_gbps=gbps, pct_of_copy=100.0 * gbps / copy_gbps)
    return row


# --------------------------------------------------------------------------- cases: check, then yield callables

def cases_project_features(p, dtype, device, args, gen):
    H, k = p["H"], p["k"]
    fc_weight = randn((H, k * H), gen, dtype, device, 1.0 / math.sqrt(k * H))
    norm_weight = randn((H,), gen, dtype, device, 0.1).add_(1.0)
    for T in args.tokens:
        a = ([randn((T, H), gen, dtype, device) for _ in range(k)], fc_weight, norm_weight, EPS)
        cat_x = torch.cat(a[0], -1)
        check_close(f"project_features[{p['name']}, {dtype}, T={T}]", ops.project_features(*a),
                    eager_project_features(*a), reference.project_features(*a), dtype)
        yield dict(tokens=T, context=None, batch=None), dict(
            fused=lambda: ops.project_features(*a), eager=lambda: eager_project_features(*a),
            linear=lambda: eager_bare_linear(cat_x, fc_weight))


def cases_inject_context_kv(p, dtype, device, args, gen):
    H, Hkv, D, N = p["H"], p["Hkv"], p["D"], p["N"]
    S = max(args.contexts) + max(args.tokens)  # cache rows: the longest context plus the new tokens
    k_weight, v_weight = (randn((N, Hkv * D, H), gen, dtype, device, 1.0 / math.sqrt(H)) for _ in range(2))
    k_norm_weight = randn((N, D), gen, dtype, device, 0.1).add_(1.0)
    ang = torch.arange(S, dtype=torch.float64)[:, None] / ROPE_THETA ** (torch.arange(0, D, 2).double() / D)
    cos, sin = (f(torch.cat([ang, ang], -1)).to(dtype).to(device) for f in (torch.cos, torch.sin))
    kv = {name: torch.zeros((2, N, S, Hkv, D), dtype=dtype, device=device) for name in ("fused", "eager", "ref")}
    for T in args.tokens:
        positions = torch.arange(min(args.contexts), min(args.contexts) + T, device=device)  # = slots
        a = (randn((T, H), gen, dtype, device), k_weight, v_weight, k_norm_weight, cos, sin, positions, positions)
        for c in kv.values():
            c.zero_()  # whole caches compared: rows outside the slots must stay zero
        for name, fn in (("fused", ops.inject_context_kv), ("eager", eager_inject_context_kv),
                         ("ref", reference.inject_context_kv)):
            fn(*a, *kv[name], EPS)
        check_close(f"inject_context_kv[{p['name']}, {dtype}, T={T}]", kv["fused"], kv["eager"], kv["ref"], dtype)
        # Every call rewrites the same rows: in-place repeats are idempotent.
        yield dict(tokens=T, context=None, batch=None), dict(
            fused=lambda: ops.inject_context_kv(*a, *kv["fused"], EPS),
            eager=lambda: eager_inject_context_kv(*a, *kv["eager"], EPS))


def cases_block_attention(p, dtype, device, args, gen):
    Hq, Hkv, D = p["Hq"], p["Hkv"], p["D"]
    scale = 1.0 / math.sqrt(D)
    for bsz in args.batch:
        for ctx_len in args.contexts:  # contexts back to back in the cache, one length: eager can batch
            cache = [randn((bsz * ctx_len, Hkv, D), gen, dtype, device) for _ in range(2)]
            idx = (torch.arange(bsz, device=device) * ctx_len, torch.full((bsz,), ctx_len, device=device))
            for Bq in args.tokens:
                a = (randn((bsz, Bq, Hq, D), gen, dtype, device), randn((bsz, Bq, Hkv, D), gen, dtype, device),
                     randn((bsz, Bq, Hkv, D), gen, dtype, device), *cache)
                name = f"block_attention[{p['name']}, {dtype}, Bsz={bsz}, Bq={Bq}, ctx={ctx_len}]"
                fused, ref = ops.block_attention(*a, *idx, scale), reference.block_attention(*a, *idx, scale)
                check_close(name, fused, eager_block_attention(*a, ctx_len, scale), ref, dtype)
                fns = dict(fused=lambda: ops.block_attention(*a, *idx, scale),
                           eager=lambda: eager_block_attention(*a, ctx_len, scale))
                if args.sdpa:
                    problem = sdpa_problem(*a, *idx, scale)
                    check_close(name, fused, sdpa_block_attention(problem).transpose(1, 2), ref, dtype, "sdpa")
                    fns["sdpa"] = lambda: sdpa_block_attention(problem)
                yield dict(tokens=Bq, context=ctx_len, batch=bsz), fns


def linear_weights(p):
    """The target's linear layers of a preset's size, as a verify pass runs them on T rows:
    (name, [out, in])."""
    H, I = p["H"], p["I"]
    shapes = [("q_proj", (p["Hq"] * p["D"], H)), ("up_proj", (I, H)), ("down_proj", (H, I))]
    return shapes + ([("lm_head", (p["V"], H))] if p["V"] * H <= LM_HEAD_MAX_ELEMENTS else [])


def cases_skinny_linear(p, dtype, device, args, gen):
    for name, (n_out, n_in) in linear_weights(p):
        weight = randn((n_out, n_in), gen, dtype, device, 1.0 / math.sqrt(n_in))
        for T in args.tokens:
            x = randn((T, n_in), gen, dtype, device)
            check_close(f"skinny_linear[{p['name']} {name}, {dtype}, T={T}]", ops.skinny_linear(x, weight),
                        torch.nn.functional.linear(x, weight), reference.skinny_linear(x, weight), dtype,
                        other_name="F.linear")
            yield dict(tokens=T, context=None, batch=None, weight=name, weight_shape=(n_out, n_in)), dict(
                fused=lambda: ops.skinny_linear(x, weight), eager=lambda: torch.nn.functional.linear(x, weight))


def cases_block_conv(p, dtype, device, args, gen):
    for H, M, B in itertools.product(args.conv_hidden or [p["H"]], args.batch, args.conv_blocks):
        G = H // CONV_GROUP
        a = (randn((M, B, H), gen, dtype, device), randn((CONV_TAPS, H), gen, dtype, device, 0.5),
             randn((M, B, CONV_TAPS, G), gen, dtype, device, 0.5))
        fused, ref = ops.block_conv(*a), reference.block_conv(*a)
        check_close(f"block_conv[{dtype}, M={M}, B={B}, H={H}]", fused, eager_block_conv(*a), ref, dtype)
        yield dict(tokens=B, context=None, batch=M, hidden=H, conv_shape=(M, B, H, CONV_TAPS, G)), dict(
            fused=lambda: ops.block_conv(*a), eager=lambda: eager_block_conv(*a),
            reference=lambda: reference.block_conv(*a))


CASES = dict(project_features=cases_project_features, inject_context_kv=cases_inject_context_kv,
             block_attention=cases_block_attention, skinny_linear=cases_skinny_linear, block_conv=cases_block_conv)


# --------------------------------------------------------------------------- goals and output

def path_taken(op, dtype, preset, tag, device):
    """The kernel path `op` takes now for a case: dflash_ext.ops.hardware.cpu_paths, given the shape
    arguments it takes (GEMM rows; attention keys and query rows per KV head); else the device."""
    if device.type != "cpu" or not hasattr(hardware, "cpu_paths"):
        return None if device.type == "cpu" else device.type
    p, T = PRESETS[preset], tag["tokens"]
    weights = {"project_features": p["H"] * p["k"] * p["H"],
               "skinny_linear": math.prod(tag.get("weight_shape") or (0,))}.get(op, 2 * p["N"] * p["Hkv"] * p["D"] * p["H"])
    shape = dict(rows=T, weight_bytes=weights * torch.empty((), dtype=dtype).element_size(),
                 keys=(tag["context"] or 0) + T, query_rows=T * p["Hq"] // p["Hkv"])
    params = inspect.signature(hardware.cpu_paths).parameters
    return hardware.cpu_paths(dtype, **{k: v for k, v in shape.items() if k in params}).get(op)


def measure_row(row, fns, timing, copy):
    """Time the callables of one case; returns `row` with medians, ratios, bandwidth and goal."""
    t, info = _common.measure(fns, **timing)
    row.update({f"{n}_ms": v for n, v in t.items()}, ratio=t["eager"] / t["fused"])
    row.update({f"ratio_vs_{n}": t[n] / t["fused"] for n in ("linear", "sdpa", "reference") if n in t})
    if copy:
        add_bandwidth(row, copy["copy_gbps"])
    return dict(row, goal=goal_status(row), **info)


def goal_status(row):
    """'ok', 'MISS', 'miss~' (within NOISE of the goal) or '-' (no goal at this size)."""
    key, target, applies, _ = GOALS[row["op"]]
    if not applies(row):
        return "-"
    return "ok" if row[key] >= target else "miss~" if row[key] >= target * (1 - NOISE) else "MISS"


def table(op, rows):
    cols = ["preset", "dtype", "isa", "path", ("tokens", {"block_attention": "Bq", "block_conv": "B"}.get(op, "T"), "{}")]
    cols += ["batch", "context"] if op == "block_attention" else []
    cols += [("batch", "M", "{}"), ("hidden", "H", "{}")] if op == "block_conv" else []
    cols += ["weight"] if op == "skinny_linear" else []
    cols += [("fused_ms", "fused_ms", "{:.4f}"), ("eager_ms", "eager_ms", "{:.4f}"), ("ratio", "ratio", "{:.2f}x")]
    for ms, ratio in (("linear_ms", "ratio_vs_linear"), ("sdpa_ms", "ratio_vs_sdpa"),
                      ("reference_ms", "ratio_vs_reference")):
        if any(ms in r for r in rows):
            cols += [(ms, ms, "{:.4f}"), (ratio, ratio, "{:.2f}x")]
    if any("fused_gbps" in r for r in rows):
        cols += [("fused_gbps", "fused_gbps", "{:.1f}"), ("pct_of_copy", "pct_of_copy", "{:.1f}%")]
    cols += [("goal", "goal", "{}"), ("repeats", "n", lambda r: f"{r['repeats']}" + ("!" if r["noisy"] else ""))]
    return _common.format_table(rows, cols, title=f"== {op} (goal: {GOALS[op][3]})")


def parse_args(argv=None):
    ap = _common.arg_parser(__doc__, "bench_ops", budget=(0.5, 0.1), max_s=(5.0, 0.5),
                            quick_help="smoke test: T/Bq in {1, 16}, context 512, short timing")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES) + ["all"], default=["bfloat16", "float32"],
                    help="one or more, or 'all' (default: bfloat16 float32)")
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="T for project/inject, Bq for attention (default 1 4 8 16 32; --quick 1 16)")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help="block_attention context lengths (default 512 4096; --quick 512)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1], help="sequences per block_attention call (default 1)")
    ap.add_argument("--ops", nargs="+", choices=OPS, default=None,
                    help=f"ops to run (default: those of {' '.join(DEFAULT_OPS)} with a kernel on --device; "
                         "block_conv when named)")
    ap.add_argument("--conv-blocks", nargs="+", type=int, default=[4, 8, 16],
                    help="block_conv: slots per block B (default 4 8 16)")
    ap.add_argument("--conv-hidden", nargs="+", type=int, default=None,
                    help="block_conv: widths H, multiples of 16 (default: the preset's hidden size)")
    ap.add_argument("--isa", nargs="+", choices=ISA_LEVELS + ["all"], default=None,
                    help="CPU: run once per ISA level, forced with dflash_ext.ops.hardware.forced_cpu_isa; 'all': "
                         "every level up to the detected one (default: the active level, not forced)")
    ap.add_argument("--copy-mib", type=float, default=1024,
                    help="CUDA: size of the buffer whose copy measures the bandwidth (default 1024 MiB)")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or ([1, 16] if args.quick else [1, 4, 8, 16, 32])
    args.contexts = args.contexts or ([512] if args.quick else [512, 4096])
    args.dtype = list(DTYPES) if "all" in args.dtype else list(dict.fromkeys(args.dtype))
    if min(args.tokens) < 1 or min(args.contexts) < 0 or min(args.batch) < 1 or args.copy_mib <= 0:
        ap.error("--tokens and --batch must be >= 1, --contexts >= 0, --copy-mib > 0")
    if min(args.conv_blocks) < 1 or any(h < CONV_GROUP or h % CONV_GROUP for h in args.conv_hidden or []):
        ap.error(f"--conv-blocks must be >= 1, --conv-hidden positive multiples of {CONV_GROUP}")
    isa = _common.cpu_isa() if args.device == "cpu" else None
    if args.isa is None:
        args.isa_levels = [isa["active"] if isa else None]
    elif isa is None or not hasattr(hardware, "forced_cpu_isa"):
        ap.error("--isa needs --device cpu and a dflash_ext with hardware.cpu_isa / forced_cpu_isa")
    else:
        top = ISA_LEVELS.index(isa["detected"]) + 1
        args.isa_levels = ISA_LEVELS[:top] if "all" in args.isa else list(dict.fromkeys(args.isa))
        if any(ISA_LEVELS.index(level) >= top for level in args.isa_levels):
            ap.error(f"--isa {args.isa_levels}: this CPU has up to {isa['detected']}")
    return args


def main(argv=None, extras=None):
    """extras: the CUDA columns (copy bandwidth, fused_gbps, SDPA); None: on CUDA (tests force them on CPU)."""
    args = parse_args(argv)
    device, missing = _common.start(args, args.ops or DEFAULT_OPS, prog="bench_ops")
    if missing and args.ops:
        sys.exit(f"bench_ops: dflash_ext has no CUDA kernel for {missing}; run on --device cpu")
    args.ops = [op for op in args.ops or DEFAULT_OPS if op not in missing]
    args.sdpa = extras = device.type == "cuda" if extras is None else extras
    timing, log = _common.timing(args), _common.logger()
    meta = _common.metadata(device, dtypes=args.dtype, presets={n: PRESETS[n] for n in args.presets},
                            tokens=args.tokens, contexts=args.contexts, batch=args.batch, isa_levels=args.isa_levels,
                            isa_forced=args.isa is not None, timing=timing, quick=args.quick, eps=EPS,
                            goals={op: g[3] for op, g in GOALS.items()},
                            tolerances={str(d)[6:]: dict(rtol=r, atol=a) for d, (r, a) in TOLS.items()})
    copy = _common.copy_bandwidth(device, int(args.copy_mib * (1 << 20)), **timing) if extras else None
    if copy:
        meta.update(copy, sdpa_enable_gqa=sdpa_supports_gqa())
    rows = []
    try:
        for preset, dname, level in itertools.product(args.presets, args.dtype, args.isa_levels):
            gen = torch.Generator().manual_seed(args.seed)
            with hardware.forced_cpu_isa(level) if args.isa else contextlib.nullcontext():
                for op in args.ops:
                    for tag, fns in CASES[op](dict(PRESETS[preset], name=preset), DTYPES[dname], device, args, gen):
                        rows.append(measure_row(dict(op=op, preset=preset, dtype=dname, isa=level, path=path_taken(
                            op, DTYPES[dname], preset, tag, device), **tag), fns, timing, copy))
                        log(f"{op} {preset} {dname} isa={level} path={rows[-1]['path']} " + " ".join(
                            f"{k}={v}" for k, v in tag.items() if v) + f": ratio {rows[-1]['ratio']:.2f}x")
    except MismatchError as e:
        return _common.fail(e)

    print(f"# dflash_ext fused ops vs plain PyTorch | {_common.header(meta)}")
    if meta["cpu_isa"] and device.type == "cpu":
        print(f"# CPU ISA features: {' '.join(meta['cpu_isa']['features'])}; columns isa / path: the ISA level the "
              "CPU kernels ran at and the path each op took there")
    print("# medians in ms; ratio = eager_ms / fused_ms; ratio_vs_linear = linear_ms / fused_ms; ratio_vs_reference "
          "= reference_ms / fused_ms; n = timed blocks")
    if copy:
        print(f"# Copy bandwidth {copy['copy_gbps']:.1f} GB/s (median dst.copy_(src) of {copy['copy_bytes'] / 2**20:g} "
              "MiB, read + write counted); fused_gbps = min_bytes / fused_ms; pct_of_copy = fused_gbps / copy "
              "bandwidth; sdpa_ms = F.scaled_dot_product_attention alone on contiguous K/V")
    for op in OPS:
        if any(r["op"] == op for r in rows):
            print("\n" + table(op, [r for r in rows if r["op"] == op]))
    misses = [r for r in rows if r["goal"] in ("MISS", "miss~")]
    print(f"\n# Goal not met in {len(misses)} row(s) ('miss~' = within {NOISE:.0%} of the goal)" if misses
          else "\n# All goals met.")
    if any(r["noisy"] for r in rows):
        print("# WARNING: rows marked '!' kept a spread (IQR / median) >= 10% within --max-wait: unreliable")
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
