#!/usr/bin/env bash
# Issue 45's eighth long run (2026-12-07, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): step 18 (then bench/results/training/continue-from; git history f07ce89) continued in ONE 680-step
# cosine, peak lr 1e-4, over all the committed data (19,682 + 982 records of later-turns-6, --seed 19).
# Run from the repository root with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in place;
# made in a worktree of main at b5568b6: the first run whose live features come from cast_target's bf16 target
# (RoPE frequencies in fp32). Log: train.log; held-out tau at steps 340 and 680: eval.jsonl.
# continue-from was removed when this run shipped: `git checkout f07ce89 -- bench/results/training/continue-from` first.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 \
  datasets/smollm2-sharegpt-later-turns-3 datasets/smollm2-sharegpt-later-turns-4 \
  datasets/smollm2-sharegpt-later-turns-5 datasets/smollm2-sharegpt-later-turns-6 datasets/smollm2-stdlib-code \
  --out data/long8 --init bench/results/training/continue-from --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 680 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 340 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 19 --features live
# Then, quiet, from the repository root at 2d78ba7 (the export in /work/long/drafter8, as the JSON files name it;
# the shipped step 17 copied to /work/long/old17, "old" below; both evaluated by the same code):
#   python -m dflash_ext export --src data/long8 --dst /work/long/drafter8 --dtype bfloat16
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/drafter8 --eval-stride 1 --save-acceptance  # eval_new_stride1.json
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/old17 --eval-stride 1                       # eval_old_stride1.json
#   python -m dflash_ext eval --data data/gen-code-heldout --extra-data data/gen-code --holdout 80 --drafter DIR         # eval_{new,old}_code.json
#   for i in 1 2 3; do python -m dflash_ext generate --baseline --drafter /work/long/old17 --json demo_old_$i.json  # demo_old_$i.txt
#                      python -m dflash_ext generate --baseline --drafter /work/long/drafter8 --json demo_new_$i.json; done
#   for d in drafter8 old17; do python -m bench.e2e --drafter /work/long/$d --sets humaneval mtbench sharegpt --n 10 \
#     --max-new-tokens 128 --dtype bfloat16 --block-size auto --streamed-target --no-progress --json e2e_bfloat16_$d.json --png ''; done
#   python -m bench.e2e --drafter /work/long/drafter8 ... --dtype float32 ...                                          # e2e_float32_drafter8.*
