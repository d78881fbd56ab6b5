#!/usr/bin/env bash
# One call that grows the drafter: the verifier writes more questions (naming subtopics once
# the listed subjects' seeds are spent), answers them in waves, the whole dataset's hidden
# states are rebuilt, and the shipped head trains on all of it for the time left. Back in
# $OUT: the grown dataset (no hidden states), the head, its curve and the logs.
#   Q_S, GEN_S: seconds for questions and answers; BUDGET: seconds for the whole call.
set -u
R=$PWD; J=${J:-/tmp/job}; O=$OUT; mkdir -p $J
T0=$(date +%s); BUDGET=${BUDGET:-540}
MODEL=${MODEL:-smollm2}; DSTAR=${DSTAR:-results/distill-smollm2-7.6M.tar.xz}
HEAD=${HEAD:-macfleet/engine/proposers/weights/smollm2-eagle}; B=${B:-64}; SEQ=${SEQ:-256}
GB=${GB:-512}
. "$R/.ci/gpu/env.sh"
last() { tr '\r' '\n' < $1 | grep -v '^$' | tail -${2:-2} | tee -a $O/log.txt; }
t start
tar xJf $DSTAR -C $J
t questions  # a stopped run keeps every wave it finished (appended as it goes)
timeout -s TERM ${Q_S:-60} $PY -m macfleet distill --model $MODEL --dataset $J/ds \
  --stage questions --questions 10000000 --gen-batch $GB > $J/q.log 2>&1
last $J/q.log 3
t answers  # a stopped run writes its open shard
timeout -s TERM ${GEN_S:-180} $PY -m macfleet distill --model $MODEL --dataset $J/ds \
  --tokens 1000000000 --gen-batch $GB --gen-mode waves --max-tokens 256 --stage data \
  > $J/data.log 2>&1
last $J/data.log
t features
$PY -m macfleet distill --model $MODEL --dataset $J/ds --stage features \
  --features-batch 65536 > $J/features.log 2>&1
last $J/features.log
# what is left, less: loading and the held-out measures around training (~60 s), packing (~30 s)
TL=$(( T0 + BUDGET - $(date +%s) - 90 )); [ $TL -lt 30 ] && TL=30
t "train ${TL} s"
timeout -s INT $((TL + 60)) $PY -m macfleet distill --model $MODEL --dataset $J/ds \
  --stage train --init $HEAD --steps 100000 --time-limit $TL --batch $B --seq-len $SEQ \
  --unroll 3 --lr 5e-4 --save-every 250 --target hard --work $J/w --out $J/o/head \
  > $J/train.log 2>&1
echo "train exit $?" | tee -a $O/log.txt
last $J/train.log 4
t pack
[ -f $J/o/head.safetensors ] && cp $J/o/head.safetensors $O/head.safetensors
(cd $J && tar cJf $O/ds.tar.xz --exclude='*.hidden.npy' ds)
(cd $J && tar cJf $O/meta.tar.xz o/*.json w/*.jsonl *.log 2>/dev/null)
ls -la $O; t done
