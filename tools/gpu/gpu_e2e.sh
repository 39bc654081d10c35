#!/usr/bin/env bash
# DFlash end to end at Qwen3-8B's shapes on one GPU, in one device call (about 13 minutes with the batch sweep):
#   0. refuses at once without CUDA (its Python part runs on the CPU as
#      `python -m bench.gpu_e2e --small`, the smoke test);
#   1. records the machine; installs the wheels carried in .whl/ (tools/gpu/wheels.txt:
#      transformers 5.25 and what it needs; the image has 5.17) and checks the import;
#   2. builds the extension for Hopper only (sm90a: the drafter's fused ops);
#   3. runs the CUDA cases of python_tests/decode/test_static_cache.py (the compiled verify
#      and one-token passes equal the target's own greedy tokens);
#   4. runs bench.gpu_e2e: random bf16 weights initialised on the GPU; per context (1k, then
#      8k) the target alone (eager, static compiled), our step (eager, static with the
#      compiled verify), transformers' DFlash loop; then the forced-acceptance check. The
#      compiles (reduce-overhead: CUDA graphs) happen in the untimed warm-up steps and are
#      the budget's largest part; the JSON is rewritten after each row, so a run cut short
#      keeps the rows before it;
#   5. the batch sweep (bench.gpu_e2e --rows batch: DFlash and the target alone over 16
#      prompts in batches of 1, 2, 4, 8, 16, each row checked; OUT_DIR/batch/gpu_e2e.json);
#   6. the tree row (issue 66: the median step per tree node budget 4..64 beside the chain's;
#      OUT_DIR/tree/gpu_e2e.json). Not yet run on a GPU.
# Usage: tools/gpu/gpu_e2e.sh [OUT_DIR]   (default: $OUT, else ./gpu_e2e_out)
# Every step logs to OUT_DIR/<step>.log, OUT_DIR/summary.txt has one line per step, the
# results are OUT_DIR/gpu_e2e.json and .txt; the exit code is non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
OUT_DIR=${1:-${OUT:-gpu_e2e_out}}
if ! "${PYTHON:-python3}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_e2e.sh: no CUDA device here (torch.cuda.is_available() is False); this script needs a GPU." >&2
  echo "Its Python part runs on the CPU as: python -m bench.gpu_e2e --small --out DIR" >&2
  exit 2
fi
. tools/gpu/common.sh  # step, machine, install_cutlass, build; PY, CXX, CUDA_HOME

WHEELS="${TMPDIR:-/tmp}/dflash_gpu_e2e_wheels"
wheels() {  # the carried wheels (tools/gpu/wheels.txt), then the versions the loop needs
  rm -rf "$WHEELS"
  if ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEELS" .whl/*.whl
  fi
  PYTHONPATH="$WHEELS${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PY'
import transformers
from transformers import StaticCache  # noqa: F401
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
print("transformers", transformers.__version__, "from", transformers.__file__)
major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
if (major, minor) < (5, 24):
    raise SystemExit(f"transformers {transformers.__version__} is too old (>= 5.24 needed): carry the wheels of "
                     "tools/gpu/wheels.txt in .whl/")
PY
}
export WHEELS
export -f wheels

step machine 15 machine
step wheels 30 wheels || exit 1
step install_cutlass 15 install_cutlass
export PYTHONPATH="$WHEELS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export DFLASH_CUDA_ARCHS=${DFLASH_CUDA_ARCHS:-sm90a}  # the H200 only: half the build time
if ! step build 150 build; then
  echo "build failed: see $OUT_DIR/build.log" | tee -a "$SUMMARY"
  exit 1
fi
step tests 50 "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda --junitxml="$OUT_DIR/tests.xml" \
  python_tests/decode/test_static_cache.py
step gpu_e2e 270 "$PY" -m bench.gpu_e2e --device cuda --out "$OUT_DIR" \
  --rows alone ours hf alone_static ours_static oracle
# The batch sweep (DFlash and the target alone batched, 1..16 prompts; bench.batch), its own step and JSON.
step gpu_batch 240 "$PY" -m bench.gpu_e2e --device cuda --rows batch --out "$OUT_DIR/batch"
# The tree row (issue 66): a chain step and tree steps of 4..64 nodes per context, eager (OUT_DIR/tree/gpu_e2e.json).
step gpu_tree 180 "$PY" -m bench.gpu_e2e --device cuda --rows tree --out "$OUT_DIR/tree"
cat "$SUMMARY"
exit "$failed"
