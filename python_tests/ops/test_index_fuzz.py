"""Every int64 value of every index argument (positions, slots, cache_offsets, cache_lens,
window, the last with causal off and on) either computes what the reference computes or raises a RuntimeError naming the
argument, and never touches memory outside the tensors: near 0, S, P, 2^31, 2^62 and
2^63-1, their negatives, and sums that overflow int64. The cases run in child processes
(python_tests/ops/index_fuzz_cases.py) so that an out-of-bounds crash fails the test."""
import json
import os
import subprocess
import sys

import pytest

import dflash_ext
from python_tests.helpers import DEVICES

HERE = os.path.dirname(os.path.abspath(__file__))
# The child imports the dflash_ext this process tests (a worktree's in-place build, not
# another one the interpreter would find first).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dflash_ext.__file__)))


def run_child(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "index_fuzz_cases.py"), *args], cwd=HERE,
                          capture_output=True, text=True, timeout=600, env=env)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0:
        last = next((l for l in reversed(lines) if l.startswith("CASE ")), "no case started")
        pytest.fail(f"child exited with {proc.returncode} (negative: killed by that signal) at {last}\n"
                    f"{proc.stderr[-3000:]}")
    bad = json.loads(next(l for l in lines if l.startswith("BAD "))[4:])
    assert bad == [], bad[:20]
    return lines


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["attention", "inject"])
def test_index_extremes(op, device):
    lines = run_child(op, device)
    assert int(lines[-1].split()[1]) >= (500 if op == "attention" else 60)  # every case ran


@pytest.mark.parametrize("device", DEVICES)
def test_random_int64_indices(device):
    run_child("hypothesis", device, "300")
