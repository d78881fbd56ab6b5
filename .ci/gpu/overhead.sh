#!/usr/bin/env bash
# One call after the part calls and setup.sh (issue 30): how much of the GPU the product keeps.
#   1. bench overhead: smollm2 in float32 and bfloat16 (plain vs mlx-lm, the oracle drafter vs
#      the ideal from verify(L), the default drafter, plain and the default drafter through the
#      serving engine against the loops (issue 49), block-vs-one-token departures) and a
#      random-weight 3b llama in bfloat16;
#   2. bench drafter --no-agents (every drafter on the held-out prompts, one process);
#   3. bench serve: `serve --local` modes and mlx_lm.server (on `macfleet export`'s copy of the
#      same weights) at 1 and 16 clients;
#   4. with the time left, bench serve --head-to-head (both servers up, alternating rounds);
#   5. bench pair (issue 42) at a wider verifier, when time is left (S_SERVE/S_DRAFTER smaller
#      to make room: PAIR_SETTINGS, PAIR_PROMPTS, PAIR_TOKENS; PAIR_SESSIONS > 1 adds rounds of
#      that many requests at once).
# Each stage runs under its share of BUDGET seconds (the call's limit is 600); results, logs
# and a summary come back in $OUT (results/ holds the bench files as they would be committed).
# Dry run on a CPU: see README.md (LOCAL=1 with a tiny model).
set -u
R=$PWD; O=$OUT; J=${J:-/tmp/ovjob}; mkdir -p $O/results $J
T0=$(date +%s); BUDGET=${BUDGET:-560}
MODEL=${MODEL:-smollm2}; DTYPES=${DTYPES:-float32,bfloat16}
BIG=${BIG:-3b}; BIG_DTYPE=${BIG_DTYPE:-bfloat16}
TOKENS=${TOKENS:-96}; ROUNDS=${ROUNDS:-2}; PROMPTS=${PROMPTS:-6}; KS=${KS:-1,3,7,15}
DRAFTER_ARGS=${DRAFTER_ARGS:-}  # e.g. "--proposer none,ngram" for a model without a head
SERVE_MODEL=${SERVE_MODEL:-$MODEL}; EXPORT_MODEL=${EXPORT_MODEL:-smollm2:dense}
CLIENTS=${CLIENTS:-1,16}; SERVE_TOKENS=${SERVE_TOKENS:-32}; H2H_ROUNDS=${H2H_ROUNDS:-4}
S_OVERHEAD=${S_OVERHEAD:-200}; S_DRAFTER=${S_DRAFTER:-100}; S_SERVE=${S_SERVE:-120}
S_PAIR=${S_PAIR:-130}  # bench pair (issue 42), after the rest
. "$R/.ci/gpu/env.sh"
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
stage() {  # name, seconds (capped by what is left), command...
  local name=$1 s=$2; shift 2
  local l; l=$(left); [ "$s" -gt "$l" ] && s=$l
  if [ "$s" -lt 20 ]; then t "$name skipped: $l s left"; return 0; fi
  t "$name (up to $s s)"
  timeout -k 10 "$s" "$@" > "$O/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$O/log.txt"
  grep -v '^\[\|^round\|^context\|tok/s, TTFT' "$O/$name.log" | tail -25 >> "$O/log.txt"
}
t start
$PY - <<'PY' 2>&1 | tee -a "$O/log.txt"
import importlib.util, mlx.core as mx
need = ("mlx_lm", "numpy", "starlette", "uvicorn", "httpx", "msgpack", "zmq", "zeroconf",
        "transformers", "matplotlib")
print("device", mx.default_device(), "mlx", mx.__version__,
      "| missing:", [m for m in need if importlib.util.find_spec(m) is None] or "none")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total \
  --format=csv,noheader | tee -a "$O/log.txt"
stage overhead "$S_OVERHEAD" $PY -m macfleet bench --out "$O/results" --model "$MODEL" overhead \
  --dtype "$DTYPES" --max-tokens "$TOKENS" --repeats "$ROUNDS" --prompts "$PROMPTS" --ks "$KS" \
  --big-shape "$BIG" --big-dtype "$BIG_DTYPE" --time-limit $(( S_OVERHEAD - 60 ))
# shellcheck disable=SC2086
stage drafter "$S_DRAFTER" $PY -m macfleet bench --out "$O/results" --model "$MODEL" drafter \
  --no-agents $DRAFTER_ARGS
stage export 60 $PY -m macfleet export --model "$EXPORT_MODEL" "$J/mlx"
stage serve "$S_SERVE" $PY -m macfleet bench --out "$O/results" --model "$SERVE_MODEL" serve \
  --clients "$CLIENTS" --max-tokens "$SERVE_TOKENS" --mlx-lm "$J/mlx" --no-stall \
  --time-limit $(( S_SERVE - 40 ))
H=$(( $(left) - 15 - S_PAIR ))
[ "$H" -ge 45 ] && stage h2h "$H" $PY -m macfleet bench --out "$O/results" --model \
  "$SERVE_MODEL" serve --clients "${CLIENTS##*,}" --max-tokens "$SERVE_TOKENS" --mlx-lm "$J/mlx" \
  --head-to-head "$H2H_ROUNDS" --time-limit $(( H - 10 ))
# issue 42: a wide SmolLM2 verifier beside the real SmolLM2 as its draft model (the dial of the
# committed results/pair_dial.json). On one GPU the two agents share the device, so the
# one-process figures (draft model in series vs mlx-lm's speculative decoding) are the ones that
# transfer; the two-agent figures say what the loop costs, not what a second Mac buys.
P=$(( $(left) - 5 ))
[ "$P" -ge 60 ] && stage pair "$P" $PY -m macfleet bench --out "$O/results" pair \
  --dial "$R/results/pair_dial.json" --settings "${PAIR_SETTINGS:-24576:0.95,24576:0.8}" \
  --prompts "${PAIR_PROMPTS:-3}" --max-tokens "${PAIR_TOKENS:-64}" \
  --sessions "${PAIR_SESSIONS:-1}"
ls -la "$O/results" | tee -a "$O/log.txt"; t done
