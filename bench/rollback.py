"""What rolling the target's cache back after a rejection costs per DFlash step, by cache kind.

How to run (from the repository root, with the extension already built)::

    .venv/bin/python -m bench.rollback            # qwen3 (crop only), gpt_oss (sliding), qwen3_5 (hybrid)
    .venv/bin/python -m bench.rollback --quick    # shorter timing
    .venv/bin/python -m bench.rollback --families qwen3_5 --hidden 1024 --context 2048

Each target is a random model of its family (dflash_ext/testing/targets.py, every width
following --hidden; sliding layers alternate with full ones, the hybrid puts a full-attention
layer every --full-every layers among Gated DeltaNet ones, as Qwen3.5 does), run as
spec_generate runs it (linear layers streamed). After a prefill of --context tokens, the
verify pass over --block tokens is timed two ways, interleaved, --reps times each:

- ``pass``: on a cache that records nothing (the cache a target alone decodes with; after
  each, untimed, its full-attention layers are cropped back to the context; its bounded layers,
  window and linear states, keep their size whatever they hold, and so their cost);
- ``recorded pass`` + ``crop``: on the cache as :class:`dflash_ext.decode.rollback.CacheRollback`
  prepares it (transformers' past recording where a layer keeps a bounded state; nothing
  otherwise), then the rollback of the block (all of it, which makes the step repeatable; a
  crop costs the same whatever it drops).

The difference is what the rollback costs per step: on a crop-only target a crop alone; on a
sliding target the window's extra rows and their trim; on a hybrid, mostly the recurrent state
computed after every token of the block (sequentially instead of chunked) and recorded.
Medians of wall times (time.perf_counter). Stdout: a table; JSON (``--json``, default
bench/out/rollback.json).
"""
import argparse
import os
import sys
import time

import torch

from bench import _common

FAMILIES = ("qwen3", "gpt_oss", "qwen3_5")
KIND = {"qwen3": "crop only (full attention)", "gpt_oss": "sliding window + full",
        "qwen3_5": "linear attention + full (hybrid)"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu only")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--json", default=os.path.join(_common.OUT_DIR, "rollback.json"),
                    help="where to write the JSON results (default bench/out/rollback.json; '' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=40, help="timed steps per variant (default 40; --quick 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--quick", action="store_true", help="10 reps")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), help=f"default: {' '.join(FAMILIES)}")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (heads of hidden/4; default 512)")
    ap.add_argument("--layers", type=int, default=8, help="target layers (default 8)")
    ap.add_argument("--vocab", type=int, default=16384, help="vocabulary (default 16384)")
    ap.add_argument("--context", type=int, default=512, help="prefilled tokens (default 512)")
    ap.add_argument("--block", type=int, default=16, help="verify block size B (default 16)")
    ap.add_argument("--window", type=int, default=128, help="sliding window of the sliding target (default 128)")
    ap.add_argument("--full-every", type=int, default=4, help="hybrid: a full-attention layer every N (default 4)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 10)
    return args


def build_target(family, args):
    from dflash_ext.testing.targets import tiny_family_target

    return tiny_family_target(family, num_hidden_layers=args.layers, vocab_size=args.vocab, hidden_size=args.hidden,
                              sliding_window=args.window, full_attention_interval=args.full_every,
                              max_position_embeddings=4 * (args.context + args.block), sharpen=1.0)


def _median(xs):
    return sorted(xs)[len(xs) // 2]


@torch.no_grad()
def measure_family(family, args):
    from transformers.cache_utils import DynamicLayer

    from dflash_ext import streamed_linears
    from dflash_ext.decode.rollback import CacheRollback
    from dflash_ext.decode.runner import TargetRunner

    target = build_target(family, args)
    runner = TargetRunner(target)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab, (1, args.context), generator=g)
    block = torch.randint(0, args.vocab, (1, args.block), generator=g)
    times = {"pass": [], "recorded_pass": [], "rollback": []}
    with streamed_linears(target):
        _, _, plain = runner(prompt, None, hidden_states=False)  # records nothing
        _, _, recorded = runner(prompt, None, hidden_states=False)
        rollback = CacheRollback(recorded, args.block)
        for rep in range(args.warmup + args.reps):  # the two variants interleaved: the same machine state
            t0 = time.perf_counter()
            runner(block, plain, hidden_states=False)
            t1 = time.perf_counter()
            for layer in plain.layers:  # untimed: the full-attention layers back to the context length
                if type(layer) is DynamicLayer:  # (bounded layers keep their size: their cost does not move)
                    layer.crop(-args.block)
            t2 = time.perf_counter()
            runner(block, recorded, hidden_states=False, rollback=rollback)
            t3 = time.perf_counter()
            rollback(args.block)
            t4 = time.perf_counter()
            if rep >= args.warmup:
                times["pass"].append(t1 - t0)
                times["recorded_pass"].append(t3 - t2)
                times["rollback"].append(t4 - t3)
    ms = {k: 1e3 * _median(v) for k, v in times.items()}
    step = 1e3 * _median([p + r for p, r in zip(times["recorded_pass"], times["rollback"])])
    spread = 1e3 * (sorted(times["pass"])[3 * len(times["pass"]) // 4] - sorted(times["pass"])[len(times["pass"]) // 4])
    # Where nothing is recorded both passes are the same call: their difference is noise, the crop is the cost.
    cost = step - ms["pass"] if rollback.records else ms["rollback"]
    return dict(family=family, kind=KIND.get(family, family), records=rollback.records,
                cache_layers=sorted({type(layer).__name__ for layer in recorded.layers}),
                pass_ms=ms["pass"], recorded_pass_ms=ms["recorded_pass"], crop_ms=ms["rollback"],
                pass_and_rollback_ms=step, rollback_ms=cost, rollback_share=cost / ms["pass"],
                pass_iqr_ms=spread, reps=args.reps)


def main(argv=None):
    args = parse_args(argv)
    device, _ = _common.start(args, prog="rollback")
    if device.type != "cpu":
        sys.exit("rollback: measures the CPU (--device cpu)")
    rows = [measure_family(f, args) for f in args.families]
    meta = _common.metadata(device, hidden=args.hidden, layers=args.layers, vocab=args.vocab, context=args.context,
                            block=args.block, window=args.window, full_every=args.full_every, reps=args.reps)
    title = (f"# rollback cost per DFlash step | random targets: hidden {args.hidden}, {args.layers} layers, vocab "
             f"{args.vocab}, window {args.window}, hybrid full every {args.full_every} | context {args.context}, "
             f"block {args.block}, fp32 | {_common.header(meta)}")
    print(title)
    print(f"# medians of {args.reps} interleaved reps. pass: the verify pass on a cache that records nothing; "
          "recorded pass and crop: the two halves of a step as spec_generate runs it (CacheRollback); "
          "rollback/step = (recorded pass + crop) - pass where the cache records, else the crop alone; "
          "IQR: the spread of the plain pass")
    print(_common.format_table(rows, [
        ("family", "target", "{}"), ("kind", "cache", "{}"), ("records", "records past", "{}"),
        ("pass_ms", "pass ms", "{:.2f}"), ("pass_iqr_ms", "IQR ms", "{:.2f}"),
        ("recorded_pass_ms", "recorded pass ms", "{:.2f}"), ("crop_ms", "crop ms", "{:.3f}"),
        ("rollback_ms", "rollback ms/step", "{:+.2f}"),
        ("rollback_share", "of the pass", lambda r: f"{100 * r['rollback_share']:+.1f} %"),
    ]))
    if args.json:
        _common.write_json(args.json, dict(metadata=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
