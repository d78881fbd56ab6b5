#!/usr/bin/env bash
# A short call: the verifier writes more questions of its own, then answers them (and the other
# offline prompt sources) in waves, appended to the 4.2M-token dataset; the dataset (tokens and
# questions, no hidden states) comes back in $OUT.
set -u
R=$PWD; J=/tmp/job; O=$OUT; mkdir -p $J; T0=$(date +%s)
t() { echo "== $1 $(( $(date +%s) - T0 )) s" | tee -a $O/log.txt; }
[ -f /tmp/site/.ready ] || { echo "no /tmp/site"; exit 3; }
NV=$(python3 -c "import nvidia; print([p for p in nvidia.__path__ if 'site-packages' in p][0])")
export LD_LIBRARY_PATH=$(ls -d $NV/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$R MACFLEET_NO_OPENBLAS=1 PYTHONUNBUFFERED=1
t start
tar xJf results/distill-smollm2-4.2M.tar.xz -C $J
t questions
timeout -s TERM ${Q_S:-55} python3 -m macfleet distill --model smollm2 --dataset $J/ds \
  --stage questions --questions ${QN:-1500} --gen-batch 512 > $J/q.log 2>&1
tr '\r' '\n' < $J/q.log | grep -v '^$' | tail -2 | tee -a $O/log.txt
t data
timeout -s TERM ${GEN_S:-120} python3 -m macfleet distill --model smollm2 --dataset $J/ds \
  --tokens 40000000 --gen-batch 512 --gen-mode waves --max-tokens 256 --stage data \
  > $J/data.log 2>&1
tr '\r' '\n' < $J/data.log | grep -v '^$' | tail -2 | tee -a $O/log.txt
t pack
(cd $J && tar cJf $O/ds.tar.xz --exclude='*.hidden.npy' ds)
(cd $J && tar cJf $O/logs.tar.xz q.log data.log)
ls -la $O; t done
