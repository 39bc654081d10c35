#!/bin/bash
# Issue 63's "nothing slower" check on the demo (python -m dflash_ext generate --baseline: one prompt, 128 tokens,
# the median of 3 alternating pairs against the fastest target alone, as ./run.sh demo runs it), the tree before the
# second pass (OLD: a worktree of af672df with this build's _C*.so) and after (NEW), alternately:
#   OLD=/path/to/af672df-worktree NEW=/path/to/main bash pairs.sh
for i in ${PAIRS:-1 2}; do
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH="$dir" .venv/bin/python -m dflash_ext generate --baseline \
       --json "/tmp/demo_${side}_$i.json" > "$OLDPWD/demo_${side}_$i.txt" 2>&1; cp "/tmp/demo_${side}_$i.json" "$OLDPWD/")
  done
done
