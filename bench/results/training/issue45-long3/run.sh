#!/usr/bin/env bash
# Issue 45's third long run (2026-12-06, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): step 13's shipped drafter, a third pass over all the committed data (the
# same 14,213 records, another order: --seed 14) in ONE 800-step cosine, peak lr 1e-4 (as step 13).
# Run from the repository root with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in
# place; made in a worktree of main at bb055f2, beside other work for most of its ~115 min. Log:
# train.log; held-out tau every 200 steps: eval.jsonl.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 datasets/smollm2-stdlib-code \
  --out data/long3 --init dflash_ext/drafters/smollm2-135m --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 800 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 200 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 14 --features live
