#!/bin/bash
# The serving engine of the tree OLD against this checkout's, alternating, one core each run:
#   bash results/draft-together/ab.sh OLD_TREE SPECS SESSIONS TOKENS [VERIFIER]
# VERIFIER defaults to the pair bench's wide SmolLM2 (macfleet bench pair builds it).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
W=${5:-$HOME/.cache/macfleet/pair/w6144-x0-eps0.0-s0-f1}
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 ROUNDS=1
for r in 1 2; do
  for arm in old new; do
    tree=$here; [ $arm = old ] && tree=$1
    echo "== $arm ($(git -C "$tree" rev-parse --short HEAD))"
    PYTHONPATH=$tree taskset -c 0 "$here/.venv/bin/python" "$here/results/draft-together/sessions.py" \
      "$W" "$2" "$3" "$4" 2>&1 | grep -v Warn | grep -E "round|ids"
  done
done
