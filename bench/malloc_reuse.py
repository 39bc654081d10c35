"""What `hardware.keep_freed_memory` saves: a short training run (the CLI's `train`, one
process, live target features) with glibc's default malloc against the same run with freed
memory kept, each in a fresh process. Prints page faults, user and system CPU seconds and
the wall time of each (start-up included), and the CPU model.

    .venv/bin/python -m bench.malloc_reuse --data data/sharegpt-7k --init dflash_ext/drafters/smollm2-135m
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench import _common

_CHILD = """
import sys
from dflash_ext.cli import main as cli
from dflash_ext.ops import hardware
if sys.argv[1] == "default":
    hardware.keep_freed_memory = lambda: False  # the CLI calls it through the module
cli.main(sys.argv[2:])
"""


def run(mode, train_args):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _CHILD, mode, "train", *train_args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return dict(malloc=mode, page_faults=after.ru_minflt - before.ru_minflt, user_s=after.ru_utime - before.ru_utime,
                sys_s=after.ru_stime - before.ru_stime, wall_s=wall)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="gen-data folder to train on")
    ap.add_argument("--init", required=True, help="drafter folder to continue from")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=256)
    args = ap.parse_args(argv)
    rows = []
    for mode in ("default", "keep"):
        with tempfile.TemporaryDirectory() as out:
            rows.append(run(mode, ["--data", args.data, "--out", out, "--init", args.init,
                                   "--block-size", str(args.block_size), "--anchors", str(args.anchors),
                                   "--batch-size", "2", "--max-steps", str(args.steps), "--lr", "1e-4",
                                   "--loss-vocab", "16384", "--save-every", "100000", "--threads", "1",
                                   "--features", "live"]))
    print(f"# {args.steps} training steps (B = {args.block_size}, {args.anchors} anchors, 2 sequences, 1 thread), "
          f"start-up included; {_common.cpu_model()}")
    print(_common.format_table(rows, [("malloc", "malloc", "{}"), ("page_faults", "page faults", "{:,}"),
                                      ("user_s", "user s", "{:.1f}"), ("sys_s", "system s", "{:.1f}"),
                                      ("wall_s", "wall s", "{:.1f}")]))


if __name__ == "__main__":
    main()
