#!/usr/bin/env bash
# The whole GPU check of dflash_ext in one run, for a machine with a CUDA GPU, nvcc and a
# CUDA build of torch, and no internet:
#   1. records the machine (nvidia-smi, torch, compute capability);
#   2. installs the CUTLASS/CuTe headers from the wheel carried in third_party/;
#   3. builds the extension in place against the local torch (every .cu file, one
#      architecture each, with its ptxas report);
#   4. runs the op tests (CPU and CUDA cases), the validation-mode and CUDA graph tests
#      (no sync with validate=False, graph replay == eager step) and the SASS/spill checks;
#   5. runs compute-sanitizer memcheck (all small cases) and racecheck (a few) on
#      tools/gpu/cuda_sanitizer_cases.py;
#   6. runs bench.draft_latency (a Qwen3-8B-shaped draft step: CUDA graph vs eager
#      fused vs reference vs the HBM floor, B in {8, 16}, context in {1k, 4k, 16k}) and a
#      short bench.bench_ops (medians, GB/s against the measured copy bandwidth).
# The step limits add up to about 9 minutes (the device tool cuts a call at 10), the most
# important first; a step that runs out is recorded as failed (rc 124) and the rest go on.
# Usage: tools/gpu/gpu_check.sh [OUT_DIR]   (default: $OUT, else ./gpu_check_out)
# Every step logs to OUT_DIR/<step>.log; OUT_DIR/summary.txt has one line per step; the
# exit code is non-zero when any step failed. PYTHON picks the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
OUT_DIR=${1:-${OUT:-gpu_check_out}}
. tools/gpu/common.sh  # step, machine, install_cutlass, build; PY, CXX, CUDA_HOME
step machine 15 machine
step install_cutlass 15 install_cutlass
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! step build 150 build; then
  echo "build failed: see $OUT_DIR/build.log" | tee -a "$SUMMARY"
  exit 1
fi
# -k cuda: the CUDA cases (the CPU ones are CI's); no -x, so one failure hides no other;
# pytest-xdist, where installed, spreads them over 4 workers.
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
step tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -m "not slow" -k cuda $XDIST --junitxml="$OUT_DIR/tests.xml" \
  python_tests/cuda/test_cuda_graph.py python_tests/ops/test_validation_modes.py python_tests/cuda/test_cuda_plans.py \
  python_tests/ops/test_project_features.py python_tests/ops/test_inject_context_kv.py \
  python_tests/ops/test_block_attention.py python_tests/ops/test_bad_inputs.py \
  python_tests/ops/test_compile_opcheck.py python_tests/cuda/test_cuda_build.py \
  python_tests/draft/test_draft_cache_growth.py python_tests/ops/test_block_conv.py \
  python_tests/ops/test_norms.py
step memcheck 40 compute-sanitizer --tool memcheck --error-exitcode 1 "$PY" -m tools.gpu.cuda_sanitizer_cases
step draft_latency 90 "$PY" -m bench.draft_latency --device cuda --kinds dflash dflash2 --presets qwen3-8b --dtype bfloat16 \
  --blocks 8 16 --contexts 1024 4096 16384 32768 --batch 1 --budget 0.3 --max-wait 2 --no-breakdown \
  --json "$OUT_DIR/draft_latency_cuda.json" --png "$OUT_DIR/draft_latency_cuda.png"
step racecheck 30 compute-sanitizer --tool racecheck --error-exitcode 1 "$PY" -m tools.gpu.cuda_sanitizer_cases --quick
step bench_ops 60 "$PY" -m bench.bench_ops --device cuda --presets qwen3-8b --dtype bfloat16 --tokens 1 16 \
  --contexts 4096 16384 --batch 1 --budget 0.1 --json "$OUT_DIR/bench_ops_cuda.json"
cat "$SUMMARY"
exit "$failed"
