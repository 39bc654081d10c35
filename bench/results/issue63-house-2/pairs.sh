#!/bin/bash
# Issue 63's "nothing slower" check after the runtime's life, the shared step and the tree/DSpark merges:
# bench.batch at batch 1 (fp32, 4 prompts x 64 tokens, the shipped drafter, B = its 4), the tree before the
# house's second pass (OLD, a worktree of af672df with this build's _C*.so copied in: csrc unchanged since but for
# comments) and after (NEW), run alternately: OLD=/path/to/af672df-worktree NEW=/path/to/main bash pairs.sh
for i in ${PAIRS:-1 2 3}; do
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH="$dir" .venv/bin/python -m bench.batch --batches 1 --prompts 4 --max-new-tokens 64 --no-hf \
       --out "/tmp/bb_${side}_$i" > "$OLDPWD/batch1_${side}_$i.txt" 2>&1)
  done
done
