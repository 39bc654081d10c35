#!/usr/bin/env bash
# Issue 45's seventh long run, step 18 (2026-12-07, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): step 17 (the shipped dflash_ext/drafters/smollm2-135m) continued in ONE 680-step
# cosine, peak lr 1e-4, over all the committed data (17,804 records + 1,878 of later-turns-5, --seed 18).
# Run from the repository root with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in place;
# made in a worktree of main at 56dd89a (so its live features came from model.to(bf16): RoPE frequencies rounded
# to bf16; cast_target, bd8b700, keeps them fp32 since). Log: train.log; held-out tau at steps 340 and 680: eval.jsonl.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 \
  datasets/smollm2-sharegpt-later-turns-3 datasets/smollm2-sharegpt-later-turns-4 \
  datasets/smollm2-sharegpt-later-turns-5 datasets/smollm2-stdlib-code \
  --out data/long7 --init dflash_ext/drafters/smollm2-135m --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 680 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 340 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 18 --features live
# Then, quiet, from the repository root at bd8b700..fbf09d3 (the export in /work/long/drafter7, as the JSON files
# name it; the shipped step 17 copied to /work/long/old17, "old" below; both evaluated by the same code):
#   python -m dflash_ext export --src data/long7 --dst /work/long/drafter7 --dtype bfloat16
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/drafter7 --eval-stride 1 --save-acceptance  # eval_new_stride1.json
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/old17 --eval-stride 1                     # eval_old_stride1.json
#   python -m dflash_ext eval --data data/gen-code-heldout --extra-data data/gen-code --holdout 80 --drafter DIR       # eval_{new,old}_code.json
#   for i in 1 2; do python -m dflash_ext generate --baseline --drafter /work/long/old17 --json demo_old_$i.json  # demo_old_$i.txt
#                    python -m dflash_ext generate --baseline --drafter /work/long/drafter7 --json demo_new_$i.json; done
#   (demos 1-2 at d22844a; 3-4 the same at fbf09d3, whose baseline runs every way timed within 25 % of the fastest)
#   for dt in bfloat16 float32; do python -m bench.e2e --drafter /work/long/drafter7 --sets humaneval mtbench sharegpt --n 10 \
#     --max-new-tokens 128 --dtype $dt --block-size auto --streamed-target --no-progress --json e2e_$dt.json --png ''; done
#   python -m bench.e2e --drafter /work/long/old17 ... --dtype bfloat16 ...  # e2e_bf16_step17.*
