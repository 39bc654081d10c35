#!/usr/bin/env bash
# Issue 45's ninth long run (2026-12-07, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): the shipped step 19 (dflash_ext/drafters/smollm2-135m at c931c35) continued in ONE
# 680-step cosine, peak lr 1e-4, over all the committed data plus datasets/smollm2-sharegpt-first-turns-9000
# (20,664 + 819 = 21,483 records, --seed 20). Run from the repository root with data/sharegpt-7k
# (../shared/data/smollm2-sharegpt-responses) in place; made in a worktree of main at c931c35, ~62 min.
# Log: train.log; held-out tau at steps 340 and 680: eval.jsonl. Its --init is step 19: git show c931c35:dflash_ext/drafters/...
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 \
  datasets/smollm2-sharegpt-later-turns-3 datasets/smollm2-sharegpt-later-turns-4 \
  datasets/smollm2-sharegpt-later-turns-5 datasets/smollm2-sharegpt-later-turns-6 datasets/smollm2-stdlib-code \
  datasets/smollm2-sharegpt-first-turns-9000 \
  --out data/long9 --init dflash_ext/drafters/smollm2-135m --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 680 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 340 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 20 --features live
# Then, quiet, from the repository root at bb4d5a9 (the export in /work/long/drafter9, as the JSON files name it;
# the shipped step 19 copied to /work/long/old19, "old" below; both evaluated by the same code):
#   python -m dflash_ext export --src data/long9 --dst /work/long/drafter9 --dtype bfloat16
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/drafter9 --eval-stride 1 --save-acceptance  # eval_new_stride1.json
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/old19 --eval-stride 1                       # eval_old_stride1.json
#   python -m dflash_ext eval --data data/gen-code-heldout --extra-data data/gen-code --holdout 80 --drafter DIR         # eval_{new,old}_code.json
#   for i in 1 2 3; do python -m dflash_ext generate --baseline --drafter /work/long/old19 --json demo_old_$i.json  # demo_old_$i.txt
#                      python -m dflash_ext generate --baseline --drafter /work/long/drafter9 --json demo_new_$i.json; done
#   for d in drafter9 old19; do python -m bench.e2e --drafter /work/long/$d --sets humaneval mtbench sharegpt --n 10 \
#     --max-new-tokens 128 --dtype bfloat16 --block-size auto --streamed-target --no-progress --json e2e_bf16_$d.json --png ''; done
#   for dd in float32 bfloat16; do python -m bench.e2e --drafter /work/long/drafter9 ... --dtype float32 --drafter-dtype $dd ...; done
#   (the bf16 e2e of step 20 and its fp32 one with the drafter in fp32: bench/results/e2e_{bf16,fp32}_streamed.*; here
#   e2e_bf16_step19.* and e2e_fp32_drafter_bf16.*), then at a fixed B = 4, 5 prompts a set:
#   for dd in float32 bfloat16; do python -m bench.e2e --drafter /work/long/drafter9 --sets humaneval mtbench sharegpt --n 5 \
#     --max-new-tokens 128 --dtype float32 --drafter-dtype $dd --block-size 4 --streamed-target ...; done   # e2e_float32_B4_drafter_$dd.*
