# Shared by the prepared GPU scripts (gpu_check.sh, gpu_e2e.sh): source it from the
# repository root after setting OUT_DIR. It sets PY, CUDA_HOME, CXX/CC (the system g++),
# SUMMARY, and defines
#   step NAME TIMEOUT_S COMMAND...   run, log to OUT_DIR/NAME.log, record rc and seconds;
#   machine                          nvidia-smi, torch and the device, nvcc, the commit;
#   install_cutlass                  the CUTLASS/CuTe headers from third_party/'s wheel into $SITE;
#   build                            the extension in place (ptxas reports into OUT_DIR/ptxas).
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ]; then
  for c in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /x/x/x)")")")"; do
    if [ -x "$c/bin/nvcc" ]; then export CUDA_HOME=$c; break; fi
  done
fi
# The system compiler, which links libstdc++ dynamically as torch does: the CUDA image's
# CXX=/opt/gcc/bin/g++ links a private static copy whose number formatting crashes every
# error message that holds a number (seen 2026-12-04; setup.py now refuses such a build).
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record status and seconds
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name: $*"
  start=$(date +%s)
  # bash -c: a step may be one of the functions below (exported)
  timeout "$limit" bash -c '"$@"' step "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$SUMMARY"
  tail -n 4 "$OUT_DIR/$name.log"
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}

machine() {
  nvidia-smi || true
  "$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1))
PY
  "$CUDA_HOME/bin/nvcc" --version
  git log -1 --format='commit %H %s' 2>/dev/null || true
}

SITE="${TMPDIR:-/tmp}/dflash_gpu_check_site"  # the CUTLASS headers only
install_cutlass() {
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" third_party/nvidia_cutlass-*.whl
}

build() {
  rm -rf build/cuda_objects
  "$PY" setup.py build_ext --inplace
  mkdir -p "$OUT_DIR/ptxas" && cp build/cuda_objects/*.ptxas.txt "$OUT_DIR/ptxas/"
}

export OUT_DIR PY SITE
export -f machine install_cutlass build
