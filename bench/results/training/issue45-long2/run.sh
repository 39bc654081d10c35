#!/usr/bin/env bash
# Issue 45's second long run (2026-12-06, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): step 12's shipped drafter, a second pass over all the committed data
# (the same 14,213 records, another order: --seed 13, --epochs 2 so the run may pass the end of the
# first epoch) in ONE 900-step cosine with a lower peak lr (1e-4; step 12: 1.5e-4). Run from the
# repository root with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in place; the
# run was made in a worktree of main at 9da802b. Log: train.log; held-out tau every 150 steps: eval.jsonl.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 datasets/smollm2-stdlib-code \
  --out data/long2 --init dflash_ext/drafters/smollm2-135m --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 900 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 150 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 13 --features live
