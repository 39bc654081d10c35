"""Latency of one whole DFlash draft step, fused ops vs the plain-PyTorch reference path.

One draft step, as DFlashProposer runs it (dflash_ext/decoding.py): the target features of
the ``tau`` tokens accepted by the last verify are projected (``project_features``) and
their K/V written into every drafter layer's context cache (``inject_context_kv``), then
the N drafter layers run over the block [last token, MASK x (B-1)] (their attention over
context + block is ``block_attention``), then the final norm, the LM head and the argmax.

How to run (from the repository root, with the extension already built)::

    .venv/bin/python bench/draft_latency.py                 # default grid for the device (CPU: < 10 min)
    .venv/bin/python bench/draft_latency.py --quick         # smoke test: < 2 min on 2 cores
    .venv/bin/python bench/draft_latency.py --presets smollm2 --blocks 4 16 --contexts 512 8192 --batch 1 4
    .venv/bin/python bench/draft_latency.py --device cuda   # full grid, bf16

Prints a table of whole-step latencies and one of the per-op breakdown on stdout (progress
on stderr); writes JSON (``--json``, default bench/out/draft_latency.json) and a PNG plot
(``--png``, default bench/out/draft_latency.png: latency vs block size, one line per
context length and path, one panel per preset and batch; needs matplotlib).

Drafter presets (real shapes, random weights; the LM head / embedding is a random [V, H]
matrix, the target's in real use):

* ``smollm2``  (SmolLM2-135M drafter): H=576, 9/3 heads, D=64, intermediate 1536,
  vocab 49152, k=5 target features, N=5 layers, 30 target layers
* ``qwen3-8b`` (Qwen3-8B drafter): H=4096, 32/8 heads, D=128, intermediate 12288,
  vocab 151936, k=5, N=5, 36 target layers

Paths: ``fused`` = the dflash_ext ops (DFlashDrafter with fused=True); ``reference`` = the
same drafter with fused=False, i.e. dflash_ext.reference: plain PyTorch computing each op
the way the reference implementation does (fp32 math, Python loop over sequences in the
attention). Everything else (linear layers, norms, RoPE of the block, LM head) is the same
PyTorch code in both paths.

Grid (``--blocks``, ``--contexts``, ``--batch``, ``--presets``, ``--dtype``, ``--tau``):
the product of the lists, per preset; configurations whose context K/V cache would exceed
``--max-kv-gb`` are skipped. Without these flags the default grid depends on the device:

* CUDA: both presets in bf16, blocks 2 4 8 10 16 32, contexts 512 2048 8192 32768,
  batch 1 4 16.
* CPU (< 10 min on 2 cores): smollm2 in fp32 with blocks 2 4 8 10 16 32 x contexts
  512 2048 8192 32768 at batch 1 and blocks 4 16 x contexts 512 8192 at batch 4 and 16;
  qwen3-8b in bf16 with blocks 4 16 x context 512 2048 at batch 1 (its 1.2 GB bf16 LM head
  alone takes ~1 s per step on a CPU without avx512_bf16).
* ``--quick``: smollm2 fp32, blocks 4 16, contexts 512 2048, batch 1 and 4 (batch 4 only at
  context 512), few repeats.

Batch: DFlashProposer / spec_generate decode one sequence; the drafter's DraftCache and
draft_hidden take a batch, so batch > 1 calls draft_hidden directly and injects the
accepted tokens of all sequences with one project_features + inject_context_kv call (the
same code as DFlashDrafter.add_context, with the slots of every sequence). At batch 1 the
step calls DFlashDrafter.add_context itself.

The context: built once per (preset, batch, context) and not timed, by injecting random
target features for ``context`` tokens (one sequence, copied to the others). With
``--context-fill auto`` (default) CPU contexts whose injection would cost more than ~100
GFLOP (qwen3-8b from ~400 tokens) are instead filled with random K/V values: the latency
does not depend on the values. On CUDA, auto always injects. Every timed step then re-injects the same ``tau`` accepted tokens
at positions context .. context+tau-1 (in-place, idempotent) and drafts the block at the
following positions, so the cache does not grow while timing.

Timing: median of many calls after warm-up (bench/_common.Timer: interleaved variants; on
CPU the quiet-machine canary check of bench_ops.py; on CUDA, CUDA events; CUDA graphs are
not used). Before timing, the fused and reference steps are checked to agree (hidden states
before the LM head, relative error); a disagreement aborts with exit status 1.

``x floor`` = measured / floor, floor = bytes the step has to move at least (every weight
read once, LM head included, plus the context K/V cache read: N x batch x (context + tau)
x Hkv x D x 2) divided by the measured copy bandwidth ((read + written bytes) / time of a
large tensor copy). On CPU the floor is informative only (compute-bound GEMMs, low-precision
GEMMs without hardware support).

Per-op breakdown (``--no-breakdown`` skips it), each piece timed by calling it directly
with inputs captured from a real step: ``project`` (project_features), ``inject``
(inject_context_kv), ``attention`` (the N layers' block_attention calls), ``layers_rest``
(embedding of the block + draft_hidden with the attention replaced by its captured output:
norms, Q/K/V/O projections, RoPE, MLP, final norm), ``lm_head`` (LM head + argmax).
"""
import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import DTYPES, OUT_DIR, Timer, format_table  # noqa: E402

import dflash_ext  # noqa: E402,F401
import dflash_ext.drafter as drafter_module  # noqa: E402
from dflash_ext import ops, reference  # noqa: E402
from dflash_ext.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids  # noqa: E402
from dflash_ext.decoding import draft_tokens  # noqa: E402

PRESETS = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, k=5, num_hidden_layers=5,
                    num_target_layers=30, rope_theta=100_000.0, rms_norm_eps=1e-5),
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, k=5, num_hidden_layers=5,
                     num_target_layers=36, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}
ALL_BLOCKS = [2, 4, 8, 10, 16, 32]
ALL_CONTEXTS = [512, 2048, 8192, 32768]
PIECES = ["project", "inject", "attention", "layers_rest", "lm_head"]
PATHS = ["fused", "reference"]
# Relative error (||fused - ref|| / ||ref||) of the hidden states allowed by the check.
CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
INJECT_GFLOP_LIMIT = 100.0


class MismatchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- grid

def default_grid(device, quick):
    """[(preset, dtype name, batch, context, block)] in run order."""
    g = []
    if quick:
        g += [("smollm2", "float32", 1, c, b) for c in (512, 2048) for b in (4, 16)]
        g += [("smollm2", "float32", 4, 512, b) for b in (4, 16)]
    elif device.type == "cuda":
        for p in PRESETS:
            g += [(p, "bfloat16", bs, c, b) for bs in (1, 4, 16) for c in ALL_CONTEXTS for b in ALL_BLOCKS]
    else:
        g += [("smollm2", "float32", 1, c, b) for c in ALL_CONTEXTS for b in ALL_BLOCKS]
        g += [("smollm2", "float32", bs, c, b) for bs in (4, 16) for c in (512, 8192) for b in (4, 16)]
        g += [("qwen3-8b", "bfloat16", 1, c, b) for c in (512, 2048) for b in (4, 16)]
    return g


def build_grid(args, device):
    given = any(x is not None for x in (args.presets, args.blocks, args.contexts, args.batch, args.dtype))
    if not given:
        return default_grid(device, args.quick)
    presets = args.presets or (["smollm2"] if args.quick else list(PRESETS))
    blocks = args.blocks or ([4, 16] if args.quick else ALL_BLOCKS)
    contexts = args.contexts or ([512, 2048] if args.quick else ALL_CONTEXTS)
    batches = args.batch or [1]
    g = []
    for p in presets:
        if args.dtype:
            dname = args.dtype
        elif device.type == "cuda" or p == "qwen3-8b":
            dname = "bfloat16"  # the Qwen3 LM head alone is 2.5 GB in fp32
        else:
            dname = "float32"
        g += [(p, dname, bs, c, b) for bs in batches for c in contexts for b in blocks]
    return g


# --------------------------------------------------------------------------- model

def build_drafter(preset, dtype, device, seed, max_block):
    """A DFlashDrafter with the preset's shapes and random weights, plus a random LM head
    [V, H] (also used as the embedding table: tied, as in SmolLM2)."""
    p = PRESETS[preset]
    L = p["num_target_layers"]
    cfg = DFlashConfig(
        hidden_size=p["hidden_size"], num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"], intermediate_size=p["intermediate_size"], vocab_size=p["vocab_size"],
        num_target_layers=L, target_layer_ids=default_target_layer_ids(L, p["k"]),
        mask_token_id=p["vocab_size"] - 1, block_size=max_block, rms_norm_eps=p["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": p["rope_theta"]}, max_position_embeddings=1 << 17)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    # Materialise directly in the target dtype (no fp32 copy of the Qwen3 weights).
    drafter = drafter.to(dtype).to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, prm in drafter.named_parameters():
            if prm.dim() == 1:  # RMSNorm weights: around 1
                prm.normal_(1.0, 0.05, generator=gen)
            else:
                prm.normal_(0.0, 1.0 / math.sqrt(prm.shape[1]), generator=gen)
        lm_w = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        lm_w.normal_(0.0, 1.0 / math.sqrt(cfg.hidden_size), generator=gen)
    return drafter, lm_w


def fill_context(drafter, cache, batch, context, fill, gen, log, fused=True):
    """Put `context` tokens in every sequence of the cache (not timed). Returns the method."""
    c = drafter.config
    k = len(c.target_layer_ids)
    H, N = c.hidden_size, c.num_hidden_layers
    kvd = c.num_key_value_heads * c.head_dim
    gflop = 2 * context * (k * H * H + 2 * N * H * kvd) / 1e9
    dev, dt = cache.k.device, cache.k.dtype
    if fill == "auto":
        fill = "inject" if dev.type == "cuda" or gflop <= INJECT_GFLOP_LIMIT else "random"
    method = fill
    t0 = time.perf_counter()
    if context == 0:
        pass
    elif method == "inject":
        chunk = 2048
        for s in range(0, context, chunk):
            n = min(chunk, context - s)
            feats = [torch.randn(n, H, generator=gen, device=dev, dtype=torch.float32).to(dt) for _ in range(k)]
            drafter.add_context(cache, 0, feats, torch.arange(s, s + n, device=dev), fused=fused)
    else:
        for buf in (cache.k, cache.v):
            for i in range(N):
                buf[i, :context].copy_(torch.randn(buf[i, :context].shape, generator=gen, device=dev,
                                                   dtype=torch.float32))
        cache.lengths[0] = context
    for b in range(1, batch):
        off = b * cache.capacity
        cache.k[:, off:off + context] = cache.k[:, :context]
        cache.v[:, off:off + context] = cache.v[:, :context]
        cache.lengths[b] = context
    log(f"    context {context} x batch {batch} filled by {method} ({gflop:.0f} GFLOP for injection) "
        f"in {time.perf_counter() - t0:.1f} s")
    return method


class _Proxy:
    """A module stand-in whose block_attention is replaced (everything else forwarded)."""

    def __init__(self, module, attention):
        self._module = module
        self.block_attention = attention

    def __getattr__(self, name):
        return getattr(self._module, name)


@contextlib.contextmanager
def patched_attention(attention):
    """Make DFlashDrafter.draft_hidden call `attention` instead of ops/reference.block_attention."""
    saved = drafter_module.ops, drafter_module.reference
    drafter_module.ops = _Proxy(saved[0], attention)
    drafter_module.reference = _Proxy(saved[1], attention)
    try:
        yield
    finally:
        drafter_module.ops, drafter_module.reference = saved


class Setup:
    """Inputs of the draft step for one (batch, context, block, tau) on one cache."""

    def __init__(self, drafter, lm_w, cache, batch, context, block, tau, gen):
        self.d, self.lm_w, self.cache = drafter, lm_w, cache
        self.batch, self.context, self.block, self.tau = batch, context, block, tau
        c = drafter.config
        dev, dt = lm_w.device, lm_w.dtype
        self.eps = c.rms_norm_eps
        # Target features of the tau accepted tokens of every sequence: k x [batch * tau, H].
        self.feats = [torch.randn(batch * tau, c.hidden_size, generator=gen, device=dev,
                                  dtype=torch.float32).to(dt) for _ in c.target_layer_ids]
        self.inj_pos = torch.arange(context, context + tau, device=dev).repeat(batch)
        ids = torch.full((batch, block), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.randint(0, c.vocab_size - 1, (batch,), generator=gen, device=dev)
        self.ids = ids
        self.block_pos = torch.arange(context + tau, context + tau + block, device=dev).repeat(batch, 1)
        drafter.rope_tables(context + tau + block + 1)  # built before timing
        drafter._stacked_kv_weights()

    # ---- the whole step
    def inject(self, fused):
        cache, d = self.cache, self.d
        cache.lengths = [self.context] * self.batch  # every call re-injects the same tau tokens
        if self.batch == 1:
            d.add_context(cache, 0, self.feats, self.inj_pos, fused=fused)
            return
        impl = ops if fused else reference
        ctx = impl.project_features(self.feats, d.fc.weight, d.hidden_norm.weight, self.eps)
        k_w, v_w, kn_w = d._stacked_kv_weights()
        cos, sin = d.rope_tables(int(self.inj_pos.max()) + 1)
        slots = torch.cat([cache.slots_for(b, self.tau) for b in range(self.batch)])
        impl.inject_context_kv(ctx, k_w, v_w, kn_w, cos, sin, self.inj_pos, slots, cache.k, cache.v, self.eps)
        cache.lengths = [self.context + self.tau] * self.batch

    def hidden(self, fused):
        embeds = F.embedding(self.ids, self.lm_w)
        return self.d.draft_hidden(self.cache, embeds, self.block_pos, fused=fused)

    def lm_head(self, hidden):
        return draft_tokens(hidden, lambda rows: F.linear(rows, self.lm_w))

    def step(self, fused):
        self.inject(fused)
        return self.lm_head(self.hidden(fused))

    # ---- the pieces, called directly
    def pieces(self, fused):
        """{piece: callable} with inputs captured from one real step of this path."""
        d, cache = self.d, self.cache
        impl = ops if fused else reference
        real_attention = impl.block_attention
        N = d.config.num_hidden_layers
        self.inject(fused)  # cache lengths now context + tau
        captured = []

        def capture(*a, **kw):
            out = real_attention(*a, **kw)
            captured.append((a, kw, out))
            return out
        with patched_attention(capture):
            hidden = self.hidden(fused)
        if len(captured) != N:
            raise RuntimeError(f"draft_hidden made {len(captured)} block_attention calls through "
                               f"dflash_ext.drafter's ops/reference, expected {N}: the breakdown of "
                               "bench/draft_latency.py needs updating")
        outs = [o for _, _, o in captured]
        calls = [0]

        def stub(*a, **kw):
            o = outs[calls[0] % N]
            calls[0] += 1
            return o
        ctx = impl.project_features(self.feats, d.fc.weight, d.hidden_norm.weight, self.eps)
        k_w, v_w, kn_w = d._stacked_kv_weights()
        cos, sin = d.rope_tables(int(self.inj_pos.max()) + 1)
        slots = (cache.offsets[:, None] + self.context
                 + torch.arange(self.tau, device=ctx.device)[None]).reshape(-1)

        def project():
            impl.project_features(self.feats, d.fc.weight, d.hidden_norm.weight, self.eps)

        def inject():
            impl.inject_context_kv(ctx, k_w, v_w, kn_w, cos, sin, self.inj_pos, slots, cache.k, cache.v,
                                   self.eps)

        def attention():
            for a, kw, _ in captured:
                real_attention(*a, **kw)

        def layers_rest():
            with patched_attention(stub):
                self.hidden(fused)

        def lm_head():
            self.lm_head(hidden)
        layers_rest()
        if calls[0] != N:
            raise RuntimeError("the attention stub was not called once per layer")
        return dict(project=project, inject=inject, attention=attention, layers_rest=layers_rest,
                    lm_head=lm_head)

    # ---- accounting
    def bytes_moved(self):
        """(weight bytes, context K/V bytes read) of one step: the floor's numerator."""
        c = self.d.config
        weights = sum(p.numel() * p.element_size() for p in self.d.parameters())
        weights += self.lm_w.numel() * self.lm_w.element_size()
        kv = (c.num_hidden_layers * self.batch * (self.context + self.tau) * c.num_key_value_heads
              * c.head_dim * 2 * self.cache.k.element_size())
        return weights, kv


def check_paths(s, dtype):
    """Fused and reference steps must agree; returns error metrics for the JSON."""
    s.inject(False)
    ref_hidden = s.hidden(False).float()
    s.inject(True)
    fused_hidden = s.hidden(True).float()
    err = ((fused_hidden - ref_hidden).norm() / ref_hidden.norm().clamp_min(1e-30)).item()
    agree = (s.lm_head(fused_hidden.to(s.lm_w.dtype)) == s.lm_head(ref_hidden.to(s.lm_w.dtype))).float().mean().item()
    if not math.isfinite(err) or err > CHECK_TOL[dtype]:
        raise MismatchError(f"fused and reference draft steps DISAGREE: relative error of the hidden "
                            f"states {err:.3g} > {CHECK_TOL[dtype]:g} (argmax agreement {agree:.2%})")
    return dict(hidden_rel_err=err, token_agreement=agree)


# --------------------------------------------------------------------------- output

def main_table(rows):
    def flag(r):
        return f"{r['repeats']}" + ("!" if r["noisy"] else "")
    cols = [("preset", "preset", "{}"), ("dtype", "dtype", "{}"), ("batch", "batch", "{}"),
            ("context", "context", "{}"), ("block_size", "B", "{}"), ("tau", "tau", "{}"),
            ("fused_ms", "fused_ms", "{:.3f}"), ("reference_ms", "ref_ms", "{:.3f}"),
            ("speedup", "ref/fused", "{:.2f}x"), ("floor_ms", "floor_ms", "{:.3f}"),
            ("x_floor_fused", "fused x floor", "{:.1f}"), ("x_floor_reference", "ref x floor", "{:.1f}"),
            ("context_fill", "ctx fill", "{}"), ("repeats", "n", flag)]
    return format_table(rows, cols)


def breakdown_table(rows):
    out = []
    for r in rows:
        for path in PATHS:
            b = (r.get("breakdown") or {}).get(path)
            if not b:
                continue
            whole = r[f"{path}_ms"]
            item = dict(preset=r["preset"], batch=r["batch"], context=r["context"], block_size=r["block_size"],
                        path=path, whole=whole, sum=b["sum_ms"], noisy=b["noisy"])
            for piece in PIECES:
                item[piece] = b[f"{piece}_ms"]
            out.append(item)
    if not out:
        return None

    def piece_fmt(piece):
        return lambda r: f"{r[piece]:.3f} ({100 * r[piece] / r['sum']:.0f}%)"
    cols = [("preset", "preset", "{}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
            ("block_size", "B", "{}"), ("path", "path", "{}")]
    cols += [(p, p + "_ms", piece_fmt(p)) for p in PIECES]
    cols += [("sum", "sum_ms", "{:.3f}"), ("whole", "step_ms", "{:.3f}"),
             ("noisy", "noisy", lambda r: "!" if r["noisy"] else "")]
    return format_table(out, cols)


def plot(rows, path):
    plt = _common.pyplot()
    if plt is None or not rows:
        return False
    panels = sorted({(r["preset"], r["dtype"], r["batch"]) for r in rows},
                    key=lambda x: (list(PRESETS).index(x[0]), x[2]))
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4.2 * nrow), squeeze=False)
    contexts = sorted({r["context"] for r in rows})
    colors = {c: plt.cm.viridis(i / max(1, len(contexts) - 1)) for i, c in enumerate(contexts)}
    for ax, (preset, dname, bsz) in zip(axes.flat, panels):
        sub = [r for r in rows if (r["preset"], r["dtype"], r["batch"]) == (preset, dname, bsz)]
        for ctx in contexts:
            for kind, style in (("fused", "-o"), ("reference", "--s")):
                pts = sorted((r["block_size"], r[f"{kind}_ms"]) for r in sub
                             if r["context"] == ctx and r.get(f"{kind}_ms") is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[ctx],
                            label=f"ctx {ctx} {kind}", markersize=4)
        ax.set_title(f"{preset} {dname} batch {bsz}")
        ax.set_xlabel("block size B")
        ax.set_ylabel("draft step latency (ms, median)")
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter, LogLocator
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        blocks = sorted({r["block_size"] for r in sub})
        ax.set_xticks(blocks)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("DFlash draft step: fused (solid) vs reference (dashed)")
    return _common.save_figure(fig, path)


# --------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=None)
    ap.add_argument("--blocks", nargs="+", type=int, default=None, help=f"block sizes B (all: {ALL_BLOCKS})")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help=f"context lengths in the drafter cache (all: {ALL_CONTEXTS})")
    ap.add_argument("--batch", nargs="+", type=int, default=None, help="sequences per step (default 1)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default: bf16 on CUDA and for qwen3-8b, else fp32")
    ap.add_argument("--tau", type=int, default=4, help="accepted tokens injected per step (default 4)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--context-fill", choices=["auto", "inject", "random"], default="auto",
                    help="how the context is built (default auto: inject unless > ~100 GFLOP)")
    ap.add_argument("--max-kv-gb", type=float, default=None,
                    help="skip configurations whose K/V cache exceeds this (default 4 on CPU, 40 on CUDA)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-op breakdown")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls of each variant (default 2; quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="max timed calls (default 50; quick 8)")
    ap.add_argument("--min-repeats", type=int, default=None, help="min timed calls (default 5; quick 3)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed calls per measurement once --min-repeats are done (default 2; quick 0.3)")
    ap.add_argument("--max-wait", type=float, default=None,
                    help="CPU: seconds a measurement waits for a quiet machine (default 10; quick 1)")
    ap.add_argument("--no-quiet-check", action="store_true", help="CPU: keep calls made while the machine is busy")
    ap.add_argument("--quick", action="store_true", help="smoke test, < 2 min on 2 cores (see the grid above)")
    ap.add_argument("--json", default=os.path.join(OUT_DIR, "draft_latency.json"))
    ap.add_argument("--png", default=os.path.join(OUT_DIR, "draft_latency.png"), help="'' for no plot")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick

    def pick(v, default, quick_default):
        return v if v is not None else (quick_default if q else default)
    args.warmup = pick(args.warmup, 2, 1)
    args.repeats = pick(args.repeats, 50, 8)
    args.min_repeats = pick(args.min_repeats, 5, 3)
    args.budget = pick(args.budget, 2.0, 0.3)
    args.max_wait = pick(args.max_wait, 10.0, 1.0)
    if args.tau < 1:
        ap.error("--tau must be >= 1")
    if any(b < 2 for b in args.blocks or []):
        ap.error("--blocks must be >= 2 (the last token plus at least one MASK)")
    if any(c < 0 for c in args.contexts or []) or any(b < 1 for b in args.batch or []):
        ap.error("--contexts must be >= 0 and --batch >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    missing = _common.check_device(device)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    max_kv_gb = args.max_kv_gb if args.max_kv_gb is not None else (40.0 if device.type == "cuda" else 4.0)
    paths = [p for p in PATHS if not (p == "fused" and missing)]
    if missing:
        print(f"WARNING: dflash_ext has no {device.type} kernel for {missing}: timing the reference path only",
              file=sys.stderr)
    grid = build_grid(args, device)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    busy = _common.warn_if_busy(device, log)
    bw = _common.copy_bandwidth_gbs(device)
    timer = Timer(device, args.warmup, args.repeats, args.min_repeats, args.budget,
                  quiet_check=not args.no_quiet_check, max_wait=args.max_wait)
    meta = _common.machine_metadata(device)
    meta.update(copy_bandwidth_gbs=round(bw, 2), busy_fraction=busy, tau=args.tau, quick=args.quick, warmup=args.warmup,
                repeats=args.repeats, min_repeats=args.min_repeats, budget_s=args.budget,
                max_wait_s=args.max_wait, cuda_graphs=False, paths=paths, max_kv_gb=max_kv_gb,
                presets={k: v for k, v in PRESETS.items() if k in {g[0] for g in grid}},
                grid=[dict(preset=p, dtype=d, batch=bs, context=c, block_size=b) for p, d, bs, c, b in grid],
                notes=["random weights; LM head = embedding table (random [V, H])",
                       "batch > 1: draft_hidden called directly, accepted tokens of all sequences injected "
                       "in one project_features + inject_context_kv call",
                       "floor = (weight bytes + context K/V bytes read) / copy bandwidth",
                       "CUDA graphs not used"])
    log(f"draft_latency: torch {torch.__version__}, device {device} ({meta['device_name']}), threads "
        f"{torch.get_num_threads()}, copy bandwidth {bw:.1f} GB/s, {len(grid)} configurations, tau {args.tau}")

    rows, skipped = [], []
    groups = {}
    for p, d, bs, c, b in grid:  # one drafter per (preset, dtype); one cache per (batch, context)
        groups.setdefault((p, d), {}).setdefault((bs, c), []).append(b)
    try:
        for (preset, dname), caches in groups.items():
            dtype = DTYPES[dname]
            max_block = max(b for bl in caches.values() for b in bl)
            t0 = time.perf_counter()
            drafter, lm_w = build_drafter(preset, dtype, device, args.seed, max_block)
            log(f"{preset} {dname}: drafter built in {time.perf_counter() - t0:.1f} s")
            gen = torch.Generator(device=device).manual_seed(args.seed + 1)
            cfg = drafter.config
            for (bsz, context), blocks in caches.items():
                capacity = context + args.tau
                kv_gb = 2 * cfg.num_hidden_layers * bsz * capacity * cfg.num_key_value_heads * cfg.head_dim \
                    * lm_w.element_size() / 1e9
                if kv_gb > max_kv_gb:
                    log(f"  skip {preset} batch {bsz} context {context}: K/V cache {kv_gb:.1f} GB > --max-kv-gb")
                    skipped += [dict(preset=preset, dtype=dname, batch=bsz, context=context, block_size=b,
                                     reason=f"kv cache {kv_gb:.1f} GB > {max_kv_gb} GB") for b in blocks]
                    continue
                cache = drafter.new_cache(bsz, capacity)
                fill = fill_context(drafter, cache, bsz, context, args.context_fill, gen, log,
                                    fused="fused" in paths)
                for block in blocks:
                    s = Setup(drafter, lm_w, cache, bsz, context, block, args.tau, gen)
                    row = dict(preset=preset, dtype=dname, batch=bsz, context=context, block_size=block,
                               tau=args.tau, context_fill=fill)
                    if "fused" in paths:
                        row["check"] = check_paths(s, dtype)
                    fns = {path: (lambda f=(path == "fused"): s.step(f)) for path in paths}
                    t, info = timer.measure(fns)
                    for path in PATHS:
                        row[f"{path}_ms"] = t.get(path)
                        row[f"{path}_min_ms"] = info.get(f"{path}_min_ms")
                    row["speedup"] = (t["reference"] / t["fused"]) if "fused" in t else None
                    wb, kvb = s.bytes_moved()
                    row.update(bytes_weights=wb, bytes_kv=kvb, floor_ms=(wb + kvb) / (bw * 1e9) * 1e3)
                    for path in PATHS:
                        row[f"x_floor_{path}"] = row[f"{path}_ms"] / row["floor_ms"] if t.get(path) else None
                    row.update(repeats=info["repeats"], dropped=info["dropped"], passes=info["passes"],
                               noisy=info["noisy"])
                    if not args.no_breakdown:
                        fns = {}
                        for path in paths:
                            for piece, fn in s.pieces(path == "fused").items():
                                fns[f"{path}:{piece}"] = fn
                        tb, binfo = timer.measure(fns)
                        row["breakdown"] = {}
                        for path in paths:
                            b = {f"{piece}_ms": tb[f"{path}:{piece}"] for piece in PIECES}
                            b["sum_ms"] = sum(b.values())
                            b.update(repeats=binfo["repeats"], noisy=binfo["noisy"])
                            row["breakdown"][path] = b
                    rows.append(row)
                    f_ms = f"{row['fused_ms']:.3f}" if row["fused_ms"] is not None else "-"
                    sp = f" ({row['speedup']:.2f}x)" if row["speedup"] else ""
                    log(f"  {preset} {dname} batch {bsz} ctx {context} B {block}: fused {f_ms} ms, reference "
                        f"{row['reference_ms']:.3f} ms{sp}, floor {row['floor_ms']:.3f} ms, n={row['repeats']}"
                        f"{' NOISY' if row['noisy'] else ''}")
                del cache
            del drafter, lm_w
    except MismatchError as e:
        print("\n" + "!" * 78 + f"\nBUG: {e}\n" + "!" * 78, file=sys.stderr)
        print(f"BUG: {e}")
        return 1

    print(f"# DFlash draft step latency | device {device} ({meta['device_name']}) | threads "
          f"{meta['threads']} | torch {torch.__version__} | git {meta['git_commit']}"
          f"{'+dirty' if meta['git_dirty'] else ''}")
    print(f"# one step = project_features + inject_context_kv of tau={args.tau} accepted tokens per sequence "
          f"+ {', '.join(sorted({str(PRESETS[p]['num_hidden_layers']) for p, *_ in grid}))} drafter layers over "
          f"the block + final norm + LM head + argmax; medians in ms; ref/fused = reference_ms / fused_ms "
          f"(> 1: fused faster); floor = (weights + context K/V bytes) / {bw:.1f} GB/s copy bandwidth; "
          f"random weights; CUDA graphs not used; n! = noisy")
    print()
    print(main_table(rows))
    bt = breakdown_table(rows)
    if bt:
        print()
        print("# per-op breakdown (median ms, share of the sum of the pieces); step_ms = the whole step")
        print(bt)
    if skipped:
        print(f"\n# skipped {len(skipped)} configuration(s) over --max-kv-gb {max_kv_gb}")
    noisy = [r for r in rows if r["noisy"]]
    if noisy:
        print(f"# WARNING: {len(noisy)} row(s) marked '!' were measured while the machine stayed busy")
    meta.update(timer.summary())
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 2)
    print(f"# total {meta['elapsed_s']:.1f} s")
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows, skipped=skipped))
        print(f"# JSON written to {args.json}")
    if args.png and plot(rows, args.png):
        print(f"# plot written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
