"""Float tolerances for tests that compare logits: one home, one reason.

Two BLAS code paths (another CPU, another thread count, a chunked vs one-shot forward, a flat
batch vs one session) move logits of magnitude ~10 by up to ~6e-4 (measured: 5e-4 on one
x86-64 box, 6e-4 on another for the flat batch). Exact equality is not a property of caches or
batching; a wrong rollback, prefix, mask or row moves logits by O(1), which these bounds catch.
Tests that compare token ids instead say which arithmetic they rest on, by one of two names:
- "same path": both sides run the same code with the same shapes in one process (or the same
  agent twice): bit-identical floats, so ids and seeded samples are equal;
- "greedy margin": the sides take different code paths (a verify block of L tokens vs one token
  per forward, a tree vs a chain, an agent process with its own BLAS threads): logits move by
  up to ~6e-4, and greedy ids are equal unless two top logits are that close to a tie -- which
  would fail on a given machine every run, not flake. Seeded samples are never compared exactly
  across paths; their distributions are (chi-square tests).
"""

LOGIT_ATOL = 5e-3
LOGIT_RTOL = 1e-3
# Draft distributions (softmax at temperature 1): log p = z - logsumexp(z) moves by at most twice
# the largest logit move, so log-probabilities are compared within twice the logit bounds. A
# wrong prefix moves them by O(10) on the tiny test models (tests/engine/test_kv_rollback.py).
LOGPROB_ATOL = 2 * LOGIT_ATOL
LOGPROB_RTOL = 2 * LOGIT_RTOL
