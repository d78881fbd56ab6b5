#!/usr/bin/env bash
# Final call: the dataset's hidden states rebuilt (DSTAR, default the 7.6M one), then four
# training variants of the shipped head side by side on the GPU (a 2x2: token target
# hard|soft x 1|2 layers), each under the same time limit. Results in $OUT (heads, a tar of
# configs, curves and logs).
set -u
R=$PWD; J=${J:-/tmp/job}; O=$OUT; mkdir -p $J
T0=$(date +%s); BUDGET=${BUDGET:-510}
MODEL=${MODEL:-smollm2}; DSTAR=${DSTAR:-results/distill-smollm2-7.6M.tar.xz}
HEAD=${HEAD:-macfleet/engine/proposers/weights/smollm2-eagle}; B=${B:-64}; SEQ=${SEQ:-256}
. "$R/.ci/gpu/env.sh"
t start
tar xJf $DSTAR -C $J
t features
$PY -m macfleet distill --model $MODEL --dataset $J/ds --stage features \
  --features-batch 65536 > $J/features.log 2>&1
tr '\r' '\n' < $J/features.log | grep -v '^$' | tail -2 | tee -a $O/log.txt
# what is left, less: loading and the held-out measures around training (~60 s), packing (~20 s)
TL=$(( T0 + BUDGET - $(date +%s) - 90 )); [ $TL -lt 60 ] && TL=60
t "train 4 variants, ${TL} s each"
run() {  # name, extra args
  timeout -s INT $((TL + 60)) $PY -m macfleet distill --model $MODEL --dataset $J/ds \
    --stage train --init $HEAD --steps 100000 --time-limit $TL --batch $B --seq-len $SEQ \
    --unroll 3 --lr 5e-4 --save-every 250 --work $J/w-$1 --out $J/o-$1/smollm2-eagle "${@:2}" \
    > $J/$1.log 2>&1
  echo "$1 exit $?" >> $O/log.txt
  local ck=$J/w-$1/checkpoint-ds/state.json
  if [ ! -f $J/o-$1/smollm2-eagle.safetensors ] && [ -f $ck ]; then  # killed: its last checkpoint
    local st=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" $ck)
    $PY -m macfleet distill --model $MODEL --dataset $J/ds --stage train --init $HEAD \
      --steps $st --resume --batch $B --seq-len $SEQ --unroll 3 --work $J/w-$1 \
      --out $J/o-$1/smollm2-eagle "${@:2}" >> $J/$1.log 2>&1
    echo "$1 saved from its checkpoint at step $st: exit $?" >> $O/log.txt
  fi
}
run hard1 --target hard & run soft1 --target soft &
run hard2 --target hard --layers 2 & run soft2 --target soft --layers 2 &
sleep 45; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv | tee -a $O/log.txt
wait
t pack
for v in hard1 soft1 hard2 soft2; do
  [ -f $J/o-$v/smollm2-eagle.safetensors ] && cp $J/o-$v/smollm2-eagle.safetensors $O/$v.safetensors
  grep -v '^step' $J/$v.log | tail -4 | sed "s/^/$v: /" | tee -a $O/log.txt
  grep '^step' $J/$v.log | tail -1 | sed "s/^/$v: /" | tee -a $O/log.txt
done
(cd $J && tar cf $O/meta.tar o-*/*.json w-*/*.jsonl *.log)
ls -la $O; t done
