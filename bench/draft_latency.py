"""Latency of one whole DFlash draft step, fused ops vs the plain-PyTorch reference path.

    .venv/bin/python -m bench.draft_latency                 # default grid for the device
    .venv/bin/python -m bench.draft_latency --quick         # smoke test
    .venv/bin/python -m bench.draft_latency --presets smollm2 --blocks 4 16 --contexts 512 8192 --batch 1 4
    .venv/bin/python -m bench.draft_latency --device cuda

One step, as DFlashProposer runs it: project_features + inject_context_kv of the ``tau``
tokens the last verify accepted, the N layers over the block [last token, MASK x (B-1)]
(block_attention), final norm, LM head, argmax; ``fused`` (a DraftRuntime with fused=True) vs
``reference`` (fused=False), and on CUDA ``graph``: the fused step with validate=False (no
host sync) captured once in a CUDA graph and replayed, as DFlashProposer drafts on CUDA
(--no-graph skips it). Random weights of real drafter shapes (PRESETS). Grid: the
product of --presets/--blocks/--contexts/--batch, else DEFAULT_GRIDS. The context is filled
once, untimed; each timed step re-injects the same tokens in place. Both paths' hidden states
are checked to agree first (exit status 1 if not). Medians (_common.measure); floor = (weights
+ context K/V read) / measured copy bandwidth. Breakdown: each piece called with inputs
captured from a real step (layers_rest: the step with the attention's captured output).
"""
import itertools
import math
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F

from bench import _common
from bench._common import DTYPES, OUT_DIR, MismatchError, format_table

from dflash_ext import DFlashConfig, DFlashDrafter, ops
from dflash_ext.draft.graphs import capture_cuda_graph
from dflash_ext.draft.head import greedy_draft
from dflash_ext.draft.layers import stacked_kv_weights
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.model.config import default_target_layer_ids
from dflash_ext.ops import reference

PRESETS = _common.DRAFTERS  # DFlashConfig fields, plus k target features and the rope theta
ALL_BLOCKS, ALL_CONTEXTS = [2, 4, 8, 10, 16, 32], [512, 2048, 8192, 32768]
DEFAULT_GRIDS = {  # [(preset, dtype, batches, contexts, blocks)], each expanded as a product
    "quick": [("smollm2", "float32", [1], [512, 2048], [4, 16]), ("smollm2", "float32", [4], [512], [4, 16])],
    "cuda": [(p, "bfloat16", [1, 4, 16], ALL_CONTEXTS, ALL_BLOCKS) for p in PRESETS],
    "cpu": [("smollm2", "float32", [1], ALL_CONTEXTS, ALL_BLOCKS), ("smollm2", "float32", [4, 16], [512, 8192], [4, 16]),
            ("qwen3-8b", "bfloat16", [1], [512, 2048], [4, 16])],  # qwen3 in bf16: its LM head is 2.5 GB in fp32
}
KINDS = ["dflash", "dflash2"]
# DFlash2 drafters: the published checkpoints' convolution and selector (docs/dflash2.md)
DFLASH2_SHAPES = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
PIECES, PATHS = ["project", "inject", "attention", "layers_rest", "lm_head"], ["fused", "reference"]
GRAPH = "graph"  # the fused step in a CUDA graph (CUDA only)
CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # ||fused - ref|| / ||ref||


def build_grid(args, device):
    """[(preset, dtype name, batch, context, block)] in run order."""
    if all(x is None for x in (args.presets, args.blocks, args.contexts, args.batch, args.dtype)):
        specs = DEFAULT_GRIDS["quick" if args.quick else device.type]
    else:
        specs = [(p, args.dtype or ("float32" if device.type == "cpu" and p == "smollm2" else "bfloat16"),
                  args.batch or [1], args.contexts or ([512, 2048] if args.quick else ALL_CONTEXTS),
                  args.blocks or ([4, 16] if args.quick else ALL_BLOCKS))
                 for p in args.presets or (["smollm2"] if args.quick else list(PRESETS))]
    return [(p, d, *x) for p, d, *lists in specs for x in itertools.product(*lists)]


def build_drafter(preset, dtype, device, seed, max_block, kind="dflash"):
    """A DFlashDrafter of the preset's shapes with random weights, and a random LM head [V, H];
    kind "dflash2" adds DFlash2's block convolutions and selector (DFLASH2_SHAPES)."""
    p = dict(PRESETS[preset])
    k, theta = p.pop("k"), p.pop("rope_theta")
    cfg = DFlashConfig(**p, target_layer_ids=default_target_layer_ids(p["num_target_layers"], k),
                       mask_token_id=p["vocab_size"] - 1, block_size=max_block, max_position_embeddings=1 << 17,
                       rope_parameters={"rope_type": "default", "rope_theta": theta},
                       **(DFLASH2_SHAPES if kind == "dflash2" else {}))
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter = drafter.to(dtype).to_empty(device=device).eval()  # no fp32 copy of the Qwen3 weights
    gen = torch.Generator(device=device).manual_seed(seed)
    lm_w = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    for prm in list(drafter.parameters()) + [lm_w]:  # norm weights around 1, matrices ~ 1/sqrt(fan-in)
        prm.data.normal_(*((1.0, 0.05) if prm.dim() == 1 else (0.0, prm.shape[1] ** -0.5)), generator=gen)
    return drafter, lm_w


def set_mode(runtime, fused, validate=True):
    """The runtime's path for the next calls: one cache serves the fused and the reference step."""
    runtime.fused, runtime.validate = fused, validate


def fill_context(runtime, batch, context, fill, gen, fused):
    """Put `context` tokens in every sequence of the runtime's cache (untimed); returns how."""
    cache = runtime.cache
    c, dev, dt = runtime.config, cache.k.device, cache.k.dtype
    H, kvd = c.hidden_size, c.num_key_value_heads * c.head_dim
    gflop = 2 * context * (len(c.target_layer_ids) * H * H + 2 * c.num_hidden_layers * H * kvd) / 1e9
    if fill == "auto":
        fill = "inject" if dev.type == "cuda" or gflop <= 100 else "random"
    for s in range(0, context, 2048) if fill == "inject" else []:
        n = min(2048, context - s)
        feats = [torch.randn(n, H, generator=gen, device=dev).to(dt) for _ in c.target_layer_ids]
        set_mode(runtime, fused)
        runtime.add_context(0, feats, torch.arange(s, s + n, device=dev))
    for buf in (cache.k, cache.v) if fill == "random" else []:
        buf[:, :context] = torch.randn(buf[:, :context].shape, generator=gen, device=dev).to(dt)
    for buf, b in itertools.product((cache.k, cache.v), range(1, batch)):  # the same context in every sequence
        buf[:, b * cache.capacity:b * cache.capacity + context] = buf[:, :context]
    set_lengths(cache, context)
    return fill


def set_lengths(cache, n):
    for b in range(len(cache.lengths)):
        cache.set_length(b, n)


class Setup:
    """The inputs of the draft step for one (batch, context, block, tau) on one runtime's cache."""

    def __init__(self, runtime, lm_w, batch, context, block, tau, gen):
        drafter, cache = runtime.drafter, runtime.cache
        self.rt, self.d, self.lm_w, self.cache = runtime, drafter, lm_w, cache
        self.batch, self.context, self.tau = batch, context, tau
        c, dev = drafter.config, lm_w.device
        self.feats = [torch.randn(batch * tau, c.hidden_size, generator=gen, device=dev).to(lm_w.dtype)
                      for _ in c.target_layer_ids]  # target features of the tau accepted tokens, k x [batch*tau, H]
        self.inj_pos = torch.arange(context, context + tau, device=dev).repeat(batch)
        self.slots = (cache.offsets[:, None] + context + torch.arange(tau, device=dev)).reshape(-1)
        self.ids = torch.full((batch, block), c.mask_token_id, dtype=torch.long, device=dev)
        self.ids[:, 0] = torch.randint(0, c.vocab_size - 1, (batch,), generator=gen, device=dev)
        self.block_pos = torch.arange(context + tau, context + tau + block, device=dev).repeat(batch, 1)
        runtime.cover(context + tau + block + 1)  # built before timing
        self.graph = None

    def project(self, impl):
        return impl.project_features(self.feats, self.d.fc.weight, self.d.hidden_norm.weight, self.d.config.rms_norm_eps)

    def inject_args(self, impl):
        d = self.d
        return (self.project(impl), *stacked_kv_weights(d.layers), *self.rt.rope,
                self.inj_pos, self.slots, self.cache.k, self.cache.v, d.config.rms_norm_eps)

    def inject(self, fused, validate=True):
        set_lengths(self.cache, self.context)  # every call re-injects the same tau tokens
        if self.batch == 1:
            set_mode(self.rt, fused, validate)
            return self.rt.add_context(0, self.feats, self.inj_pos)
        if fused:
            ops.inject_context_kv(*self.inject_args(ops), validate=validate)
        else:
            reference.inject_context_kv(*self.inject_args(reference))
        set_lengths(self.cache, self.context + self.tau)

    def hidden(self, fused, validate=True):
        set_mode(self.rt, fused, validate)
        return self.rt.draft_hidden(F.embedding(self.ids, self.lm_w), self.block_pos)

    def graph_step(self):
        """The fused step without validation, captured in a CUDA graph on first use, replayed."""
        if self.graph is None:
            self.graph, self.graph_out = capture_cuda_graph(lambda: self.step(True, validate=False))
        self.graph.replay()
        return self.graph_out

    def lm_head(self, hidden):
        selector = getattr(self.d, "candidate_selector", None)  # DFlash2: its path over the top-K
        return greedy_draft(hidden, self.lm_w, selector=selector, anchor=self.ids[:, 0])

    def step(self, fused, validate=True):
        self.inject(fused, validate)
        return self.lm_head(self.hidden(fused, validate))

    def pieces(self, fused):
        """{piece: callable}, with inputs captured from one real step of this path."""
        impl = ops if fused else reference
        real, calls = impl.block_attention, []
        self.inject(fused)  # cache lengths now context + tau
        with mock.patch.object(impl, "block_attention",
                               lambda *a, **kw: calls.append((a, kw, real(*a, **kw))) or calls[-1][2]):
            hidden = self.hidden(fused)
        if len(calls) != self.d.config.num_hidden_layers:
            raise RuntimeError(f"draft_hidden made {len(calls)} {impl.__name__}.block_attention calls, expected one "
                               "per layer: the breakdown of bench/draft_latency.py needs updating")
        outs = itertools.cycle([o for _, _, o in calls])
        kv_args = self.inject_args(impl)

        def layers_rest():
            with mock.patch.object(impl, "block_attention", lambda *a, **kw: next(outs)):
                self.hidden(fused)
        return dict(project=lambda: self.project(impl), inject=lambda: impl.inject_context_kv(*kv_args),
                    attention=lambda: [real(*a, **kw) for a, kw, _ in calls], layers_rest=layers_rest,
                    lm_head=lambda: self.lm_head(hidden))


def kv_bytes(cfg, batch, rows, itemsize):
    return 2 * cfg.num_hidden_layers * batch * rows * cfg.num_key_value_heads * cfg.head_dim * itemsize


def weight_bytes_read(s):
    """Every weight read once, but of DFlash2's codebooks [V, R] only the rows the selector
    gathers: each slot's K candidates and the token before it."""
    selector = getattr(s.d, "candidate_selector", None)
    books = set() if selector is None else {id(selector.predecessor_codebook), id(selector.successor_codebook)}
    wb = sum(p.numel() * p.element_size() for p in [*s.d.parameters(), s.lm_w] if id(p) not in books)
    if selector is not None:
        c = s.d.config
        rows = s.batch * (s.ids.shape[1] - 1) * (c.selector_top_k + 1)
        wb += rows * c.selector_rank * selector.successor_codebook.element_size()
    return wb


def check_paths(s, dtype, paths):
    """Fused and reference hidden states must agree; returns error metrics for the JSON."""
    h = {}
    for fused in (False, True):
        s.inject(fused)
        h[fused] = s.hidden(fused).float()
    err = ((h[True] - h[False]).norm() / h[False].norm().clamp_min(1e-30)).item()
    if GRAPH in paths:  # the replayed graph drafts the tokens the eager fused step drafts (same plan)
        eager = s.step(True, validate=False)
        if not torch.equal(s.graph_step(), eager):
            raise MismatchError("the CUDA graph replay drafts other tokens than the eager fused step")
    agree = (s.lm_head(h[True].to(s.lm_w.dtype)) == s.lm_head(h[False].to(s.lm_w.dtype))).float().mean().item()
    if not math.isfinite(err) or err > CHECK_TOL[dtype]:
        raise MismatchError(f"fused and reference draft steps DISAGREE: relative error of the hidden states "
                            f"{err:.3g} > {CHECK_TOL[dtype]:g} (argmax agreement {agree:.2%})")
    return dict(hidden_rel_err=err, token_agreement=agree)


def time_step(s, paths, timing, bw, breakdown):
    """A row's timings: the whole step of each path, its floor and the per-op breakdown."""
    steps = {"fused": lambda: s.step(True), "reference": lambda: s.step(False), GRAPH: s.graph_step}
    t, info = _common.measure({path: steps[path] for path in paths}, **timing)
    wb = weight_bytes_read(s)
    kvb = kv_bytes(s.d.config, s.batch, s.context + s.tau, s.lm_w.element_size())  # the context K/V read
    row = dict(bytes_weights=wb, bytes_kv=kvb, floor_ms=(wb + kvb) / (bw * 1e6),
               speedup=t["reference"] / t["fused"] if "fused" in t else None)
    for path in PATHS + [GRAPH]:
        row.update({f"{path}_ms": t.get(path), f"{path}_min_ms": info.get(f"{path}_min_ms"),
                    f"x_floor_{path}": t[path] / row["floor_ms"] if path in t else None})
    row["graph_speedup"] = t["fused"] / t[GRAPH] if GRAPH in t else None
    row.update(repeats=info["repeats"], noisy=info["noisy"])
    if breakdown:
        eager = [p for p in paths if p != GRAPH]
        tb, binfo = _common.measure({f"{path}:{k}": fn for path in eager for k, fn in s.pieces(path == "fused").items()},
                                    **timing)
        row["breakdown"] = {path: dict({f"{k}_ms": tb[f"{path}:{k}"] for k in PIECES}, repeats=binfo["repeats"],
                                       sum_ms=sum(tb[f"{path}:{k}"] for k in PIECES), noisy=binfo["noisy"])
                            for path in eager}
    return row


KEYS = ["kind", "preset", "dtype", "batch", "context", ("block_size", "B", "{}")]
MAIN_COLS = KEYS + ["tau", ("fused_ms", "fused_ms", "{:.3f}"), ("reference_ms", "ref_ms", "{:.3f}"),
                    ("speedup", "ref/fused", "{:.2f}x"), ("floor_ms", "floor_ms", "{:.3f}"),
                    ("x_floor_fused", "fused x floor", "{:.1f}"), ("x_floor_reference", "ref x floor", "{:.1f}"),
                    ("graph_ms", "graph_ms", "{:.3f}"), ("graph_speedup", "fused/graph", "{:.2f}x"),
                    ("x_floor_graph", "graph x floor", "{:.1f}"),
                    ("context_fill", "ctx fill", "{}"), ("repeats", "n", lambda r: f"{r['repeats']}" + "!" * r["noisy"])]
BREAKDOWN_COLS = KEYS + ["path"] + [
    (f"{p}_ms", f"{p}_ms", lambda r, p=p: f"{r[p + '_ms']:.3f} ({100 * r[p + '_ms'] / r['sum_ms']:.0f}%)")
    for p in PIECES] + [("sum_ms", "sum_ms", "{:.3f}"), ("whole", "step_ms", "{:.3f}")]


def plot(rows, path):
    """Latency vs block size, a line per context and path, a panel per (preset, dtype, batch)."""
    plt = _common.pyplot()
    if plt is None or not rows:
        return False
    panels = sorted({(r.get("kind", "dflash"), r["preset"], r["dtype"], r["batch"]) for r in rows})
    contexts = sorted({r["context"] for r in rows})
    ncol, nrow = min(3, len(panels)), math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4.2 * nrow), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        sub = [r for r in rows if (r.get("kind", "dflash"), r["preset"], r["dtype"], r["batch"]) == panel]
        for (i, ctx), (kind, style) in itertools.product(enumerate(contexts), (("fused", "-o"), ("reference", "--s"))):
            pts = sorted((r["block_size"], r[f"{kind}_ms"]) for r in sub if r["context"] == ctx and r[f"{kind}_ms"])
            if pts:
                ax.plot(*zip(*pts), style, color=plt.cm.viridis(i / max(1, len(contexts) - 1)), markersize=4,
                        label=f"ctx {ctx} {kind}")
        ax.set(title="{} {} {} batch {}".format(*panel), xlabel="block size B", ylabel="draft step latency (ms, median)",
               yscale="log", xticks=sorted({r["block_size"] for r in sub}))
        ax.yaxis.set_major_formatter("{x:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("DFlash draft step: fused (solid) vs reference (dashed)")
    return _common.save_figure(fig, path)


def parse_args(argv=None):
    ap = _common.arg_parser(__doc__, "draft_latency", budget=(1.0, 0.2), max_s=(10.0, 1.0),
                            quick_help="smoke test: smollm2 fp32, blocks 4 16, contexts 512 2048, batch 1 and 4")
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=None)
    ap.add_argument("--blocks", nargs="+", type=int, default=None, help=f"block sizes B (all: {ALL_BLOCKS})")
    ap.add_argument("--contexts", nargs="+", type=int, default=None, help=f"context lengths (all: {ALL_CONTEXTS})")
    ap.add_argument("--batch", nargs="+", type=int, default=None, help="sequences per step (default 1)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default: bf16 on CUDA and for qwen3-8b, else fp32")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=["dflash"],
                    help="drafter kinds: dflash (default) and/or dflash2 (its convolutions and selector)")
    ap.add_argument("--tau", type=int, default=4, help="accepted tokens injected per step (default 4)")
    ap.add_argument("--context-fill", choices=["auto", "inject", "random"], default="auto")
    ap.add_argument("--max-kv-gb", type=float, default=None,
                    help="skip larger K/V caches (default 4 on CPU, 40 on CUDA)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-op breakdown")
    ap.add_argument("--no-graph", action="store_true", help="on CUDA, skip the CUDA graph path")
    ap.add_argument("--png", default=os.path.join(OUT_DIR, "draft_latency.png"), help="'' for no plot")
    args = ap.parse_args(argv)
    if args.tau < 1 or min(args.blocks or [2]) < 2 or min(args.contexts or [0]) < 0 or min(args.batch or [1]) < 1:
        ap.error("--tau and --batch must be >= 1, --blocks >= 2 (the last token and a MASK), --contexts >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    device, missing = _common.start(args)
    torch.set_grad_enabled(False)
    max_kv_gb, paths = args.max_kv_gb or (40.0 if device.type == "cuda" else 4.0), PATHS[1:] if missing else PATHS
    if missing:
        print(f"WARNING: no {device.type} kernel for {missing}: timing the reference path only", file=sys.stderr)
    elif device.type == "cuda" and not args.no_graph:
        paths = paths + [GRAPH]
    grid, timing, log = build_grid(args, device), _common.timing(args), _common.logger()
    bw = _common.copy_bandwidth(device, **timing)["copy_gbps"]
    meta = _common.metadata(device, copy_bandwidth_gbs=round(bw, 2), tau=args.tau, quick=args.quick, timing=timing,
                            cuda_graphs=GRAPH in paths, paths=paths, max_kv_gb=max_kv_gb, kinds=args.kinds,
                            presets={k: v for k, v in PRESETS.items() if k in {g[0] for g in grid}},
                            grid=[dict(zip(("preset", "dtype", "batch", "context", "block_size"), g)) for g in grid])
    log(f"draft_latency: {_common.header(meta)}, copy {bw:.1f} GB/s, {len(grid)} configurations, tau {args.tau}")
    rows, skipped = [], []
    try:
        per_drafter = [(key, list(group)) for key, group in itertools.groupby(grid, key=lambda g: g[:2])]
        for kind, ((preset, dname), group) in itertools.product(args.kinds, per_drafter):  # one drafter each
            dtype = DTYPES[dname]
            drafter, lm_w = build_drafter(preset, dtype, device, args.seed, max(g[4] for g in group), kind)
            gen = torch.Generator(device=device).manual_seed(args.seed + 1)
            for (bsz, context), sub in itertools.groupby(group, key=lambda g: g[2:4]):  # one cache each
                where = dict(kind=kind, preset=preset, dtype=dname, batch=bsz, context=context)
                kv_gb = kv_bytes(drafter.config, bsz, context + args.tau, lm_w.element_size()) / 1e9
                if kv_gb > max_kv_gb:
                    skipped += [dict(where, block_size=g[4], reason=f"kv cache {kv_gb:.1f} GB > {max_kv_gb} GB")
                                for g in sub]
                    continue
                runtime = DraftRuntime(drafter, context + args.tau, batch_size=bsz)
                fill = fill_context(runtime, bsz, context, args.context_fill, gen, fused="fused" in paths)
                for *_, block in sub:
                    s = Setup(runtime, lm_w, bsz, context, block, args.tau, gen)
                    rows.append(dict(where, block_size=block, tau=args.tau, context_fill=fill,
                                     check=check_paths(s, dtype, paths) if "fused" in paths else None,
                                     **time_step(s, paths, timing, bw, breakdown=not args.no_breakdown)))
                    log(" ".join(f"{k} {v}" for k, v in where.items()) + f" B {block}: "
                        + ", ".join(f"{p} {rows[-1][p + '_ms']:.3f} ms" for p in paths))
                del runtime
            del drafter, lm_w
    except MismatchError as e:
        return _common.fail(e)

    print(f"# DFlash draft step latency | {_common.header(meta)}")
    print(f"# one step = project_features + inject_context_kv of tau={args.tau} accepted tokens per sequence + the "
          f"drafter layers over the block + final norm + LM head + argmax; medians in ms; ref/fused = reference_ms / "
          f"fused_ms; floor = (weights + context K/V bytes) / {bw:.1f} GB/s copy bandwidth; n! = noisy\n")
    print(format_table(rows, MAIN_COLS))
    if any("breakdown" in r for r in rows):
        print("\n# per-op breakdown (median ms, share of the sum of the pieces); step_ms = the whole step")
        print(format_table([dict(r, path=path, whole=r[f"{path}_ms"], **b) for r in rows
                            for path, b in r.get("breakdown", {}).items()], BREAKDOWN_COLS))
    if skipped:
        print(f"\n# skipped {len(skipped)} configuration(s) over --max-kv-gb {max_kv_gb}")
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows, skipped=skipped))
    if args.png and plot(rows, args.png):
        print(f"# plot written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
