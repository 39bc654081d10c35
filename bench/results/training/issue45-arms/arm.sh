#!/usr/bin/env bash
# usage: arm.sh NAME [extra train flags...]   (runs in /work/train, logs to /work/arms/NAME.log)
name=$1; shift
cd /work/train
OMP_NUM_THREADS=1 /work/main/.venv/bin/torchrun --nproc_per_node=2 -m dflash_ext train --data data/sharegpt-7k \
  --num-layers 3 --block-size 4 --anchors 256 --batch-size 8 --epochs 1 \
  --holdout 64 --eval-stride 2 --eval-every 40 --loss-vocab 16384 --save-every 20 --log-every 10 \
  --threads 1 --features live --seed 11 ${LAYERS:---layer-ids 1 8 14 20 27} --out data/arms/$name "$@" > /work/arms/$name.log 2>&1
echo "exit $?" >> /work/arms/$name.log
