#!/usr/bin/env bash
# Issue 45's sixth long run (2026-12-07, AMD EPYC family 25 model 17, avx512_bf16, 2 vCPUs, 2 processes
# x 1 thread, bf16 autocast): step 16 (bench/results/training/continue-from) continued in ONE 680-step cosine,
# peak lr 1e-4, over all the committed data (15,994 + 1,810 records of later-turns-4, --seed 17).
# Run from the repository root with data/sharegpt-7k (../shared/data/smollm2-sharegpt-responses) in place;
# made in a worktree of main at 6f41d33. Log: train.log; held-out tau at steps 340 and 680: eval.jsonl.
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --extra-data datasets/smollm2-sharegpt-later-turns datasets/smollm2-sharegpt-later-turns-2 \
  datasets/smollm2-sharegpt-later-turns-3 datasets/smollm2-sharegpt-later-turns-4 datasets/smollm2-stdlib-code \
  --out data/long6 --init bench/results/training/continue-from --num-layers 3 --block-size 4 --layer-ids 1 8 14 20 27 \
  --anchors 256 --batch-size 8 --epochs 2 --max-steps 680 --lr 1e-4 --gamma 2 \
  --holdout 64 --eval-stride 2 --eval-every 340 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --seed 17 --features live
# Then, quiet, from the repository root (the export in /work/long/drafter6, as the JSON files name it;
# step 14 = the shipped drafter before this run, copied to /work/long/old14); each demo runs 3 pairs and quotes their median:
#   python -m dflash_ext export --src data/long6 --dst /work/long/drafter6 --dtype bfloat16
#   python -m dflash_ext eval --data data/sharegpt-7k --drafter /work/long/drafter6 --eval-stride 1 --save-acceptance  # eval_new_stride1.json
#   python -m dflash_ext eval --data data/gen-code-heldout --extra-data data/gen-code --holdout 80 --drafter /work/long/drafter6  # eval_new_code.json
#   for i in 1 2; do python -m dflash_ext generate --baseline --drafter /work/long/old14 --json demo_old_$i.json  # demo_old_$i.txt
#                    python -m dflash_ext generate --baseline --drafter /work/long/drafter6 --json demo_new_$i.json; done  # demo_new_$i.txt
#   for dt in bfloat16 float32; do python -m bench.e2e --drafter /work/long/drafter6 --sets humaneval mtbench sharegpt --n 10 \
#     --max-new-tokens 128 --dtype $dt --block-size auto --streamed-target --no-progress --json e2e_$dt.json --png ''; done  # e2e_$dt.txt
