#!/usr/bin/env bash
# Issue 45's long run (2026-12-06, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs): the shipped
# drafter continued on all the committed data in ONE cosine schedule. Run from the repository root
# with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in place.
# Started with --max-steps 700 and restarted at its checkpoints with 1000 (step 80), 900 (step 140)
# and 800 (step 380) to fit the sitting, so the lr followed those cosines up to each restart
# (1.5e-4 at the 4 % warm-up's end, 1.04e-4 at step 380); the command below is the final one.
# Log: train.log; held-out tau every 100 steps: eval.jsonl.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 datasets/smollm2-stdlib-code \
  --out data/long1 --init dflash_ext/drafters/smollm2-135m --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 1 --max-steps 800 --lr 1.5e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 100 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 12 --features live
