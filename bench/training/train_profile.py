"""Where a CPU training step goes: a few steps of the CLI's `train` (one process, live target
features) under torch.profiler, then the ops by self CPU time, grouped by input shape.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.training.train_profile --data data/sharegpt-7k \
        --init dflash_ext/drafters/smollm2-135m
"""
import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_ext.cli import main as cli
from bench import _common


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="gen-data folder to train on")
    ap.add_argument("--init", required=True, help="drafter folder to continue from")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=2, help="sequences per step")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--rows", type=int, default=15, help="ops to list")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out, profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        cli.main(["train", "--data", args.data, "--out", out, "--init", args.init, "--block-size", str(args.block_size),
                  "--anchors", str(args.anchors), "--batch-size", str(args.sequences), "--max-steps", str(args.steps),
                  "--lr", "1e-4", "--loss-vocab", "16384", "--save-every", "100000", "--threads", "1",
                  "--features", "live", "--log-every", "1"])
        wall = time.perf_counter() - start
    print(f"# {args.steps} training steps (B = {args.block_size}, {args.anchors} anchors, {args.sequences} sequences, "
          f"1 thread) under the profiler: {wall:.1f} s wall, start-up included; {_common.cpu_model()}")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                             max_name_column_width=40, max_shapes_column_width=80))


if __name__ == "__main__":
    main()
