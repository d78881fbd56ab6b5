"""The continuous-batching engine on real models: one flat forward per iteration, many sessions,
and each session's greedy ids / seeded samples equal to that request served alone.

The engine is stepped on the test's own thread (`run_until_idle`), no engine thread: see
macfleet/serve/engine.py on MLX's exit abort with compiled functions in two threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import LOGIT_ATOL, LOGIT_RTOL

from macfleet.engine.batch import BatchKV, Segment, flat_forward
from macfleet.engine.events import Finished, TokensCommitted
from reference_loops import speculative_generate
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.verifier import Verifier, make_trimmable_cache
from macfleet.serve.engine import BatchEngine, EngineRequest, Overloaded, SessionFailed


def _prompts(vocab: int, n: int, seed: int, lo: int = 2, hi: int = 120) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist()
        if i % 3 == 0:  # repetitive prompts give the n-gram proposer something to accept
            base = (base[:8] * 6)[: max(lo, len(base))]
        out.append(tuple(base))
    return out


_ALONE: dict[tuple, tuple[int, ...]] = {}


def _alone(lm, prompt, max_tokens, params=GREEDY) -> tuple[int, ...]:
    """The request decoded alone by the plain loop: a pure function of its arguments, so each
    is decoded once per module (the parametrized tests ask for the same references)."""
    key = (id(lm.model), tuple(prompt), max_tokens, params)
    if key not in _ALONE:
        evs = list(speculative_generate(Verifier(lm.model), None, prompt, params=params,
                                        max_tokens=max_tokens, eos_ids=lm.eos_ids))
        _ALONE[key] = evs[-1].token_ids
    return _ALONE[key]


def _serve_all(engine: BatchEngine, reqs: list[EngineRequest]) -> list[Finished]:
    done: dict[int, object] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        def emit(ev, i=i):
            if isinstance(ev, TokensCommitted):
                streamed[i].extend(ev.tokens)
            else:
                done[i] = ev
        engine.submit(r, emit)
    engine.run_until_idle()
    assert sorted(done) == list(range(len(reqs)))
    for i, ev in done.items():
        assert isinstance(ev, Finished), ev
        assert list(ev.token_ids) == streamed[i]  # the stream is the answer, nothing retracted
    return [done[i] for i in range(len(reqs))]


def test_flat_forward_rows_match_each_session_alone(tiny):
    m = tiny.model
    prompts = _prompts(tiny.vocab_size, 5, seed=3)
    store = BatchKV(len(m.layers))
    caches = [store.open() for _ in prompts]
    flat_forward(m, [Segment(p[:-1], c, None) for p, c in zip(prompts, caches)])
    blocks = [(p[-1], 5, 7)[: 1 + i % 3] for i, p in enumerate(prompts)]
    out = flat_forward(m, [Segment(b, c, 0) for b, c in zip(blocks, caches)])
    for p, b, c, lg in zip(prompts, blocks, caches, out):
        v = Verifier(m)
        v.prefill(p[:-1])
        ref = np.array(v.forward(b))
        assert lg.shape == ref.shape
        np.testing.assert_allclose(np.array(lg), ref, rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
        assert np.array_equal(np.argmax(np.array(lg), -1), np.argmax(ref, -1))
        assert c.offset == len(p) - 1 + len(b)
    # batch-invariant mode (per-session caches): the single-session code path, bit for bit
    caches = [make_trimmable_cache(m) for _ in prompts]
    flat_forward(m, [Segment(p[:-1], c, None) for p, c in zip(prompts, caches)])
    out = flat_forward(m, [Segment(b, c, 0) for b, c in zip(blocks, caches)])
    for p, b, lg in zip(prompts, blocks, out):
        v = Verifier(m)
        v.prefill(p[:-1])
        assert np.array_equal(np.array(lg), np.array(v.forward(b)))


# The fast lane keeps chains through the batch-invariant path; token trees of two drafters in
# the flat batch run in the default suite (docs/testing.md, "Fast lane, third round")
SLOW = pytest.mark.slow


@pytest.mark.parametrize("proposer,invariant", [
    pytest.param("none", False, marks=SLOW), pytest.param("ngram", False, marks=SLOW),
    ("ngram", True), pytest.param("ngram+draft:tiny:5", False, marks=SLOW)])
def test_greedy_batched_equals_alone(tiny, proposer, invariant):
    prompts = _prompts(tiny.vocab_size, 12, seed=7)
    reqs = [EngineRequest(p, GREEDY, 8 + i % 5 * 6) for i, p in enumerate(prompts)]
    # a fixed draft length: automatic lengths follow measured costs and may drop every draft
    eng = BatchEngine(tiny, proposer=proposer, draft_tokens=4, token_budget=64, max_active=8,
                      invariant=invariant)
    got = _serve_all(eng, reqs)
    for r, f in zip(reqs, got):
        assert f.token_ids == _alone(tiny, r.prompt, r.max_tokens)
    assert eng.iterations < sum(r.max_tokens for r in reqs)  # sessions really shared forwards
    assert max(rec.sessions for rec in eng.history) > 1
    assert max(rec.decode_tokens + rec.prefill_tokens for rec in eng.history) <= 64 + (
        512 if invariant else 0)
    if proposer != "none":
        assert sum(f.stats.accepted for f in got) > 0
    for f in got:  # the histogram of accepted lengths agrees with the totals (chains, trees)
        h = f.stats.accepted_hist
        assert sum(i * c for i, c in enumerate(h)) == f.stats.accepted
        assert (sum(h) > 0) == (f.stats.drafted > 0)
    if "+" in proposer:  # token trees verified in the flat batch, per drafter statistics
        assert all(len(f.stats.per_proposer) == 2 for f in got)
        assert sum(f.stats.per_proposer[1].accepted for f in got) > 0


# a tree's sample drawn from another session's generator fails only the second, which the
# default suite runs (docs/testing.md, "Fast lane, second round" and "third round")
@pytest.mark.parametrize("proposer", ["ngram", pytest.param("ngram+draft:tiny:5", marks=SLOW)])
def test_seeded_sampling_same_alone_or_batched(tiny, proposer):
    prompts = _prompts(tiny.vocab_size, 6, seed=11)
    params = [SamplingParams(0.9, 0.95, seed=100 + i) for i in range(len(prompts))]
    reqs = [EngineRequest(p, sp, 20) for p, sp in zip(prompts, params)]
    # fixed draft lengths: the same drafts alone and batched, whatever the timings
    batched = _serve_all(BatchEngine(tiny, proposer=proposer, token_budget=48,
                                     draft_tokens=3), reqs)
    alone = [_serve_all(BatchEngine(tiny, proposer=proposer, draft_tokens=3), [r])[0]
             for r in reqs]
    assert [f.token_ids for f in batched] == [f.token_ids for f in alone]
    if proposer == "ngram":  # the chain loop's acceptance rule gives the plain loop's draws
        assert [f.token_ids for f in batched] == [_alone(tiny, r.prompt, 20, r.params)
                                                  for r in reqs]
    assert len({f.token_ids for f in batched}) > 1  # seeds differ: answers differ


def test_chunked_prefill_keeps_decoders_going(tiny):
    eng = BatchEngine(tiny, proposer="none", token_budget=32, max_active=4)
    short = [EngineRequest(p, GREEDY, 30) for p in _prompts(tiny.vocab_size, 3, 5, 2, 6)]
    long = EngineRequest(tuple(np.arange(400) % tiny.vocab_size), GREEDY, 4)
    got = _serve_all(eng, [*short, long])
    prefill_iters = [r for r in eng.history if r.prefill_tokens]
    assert all(r.prefill_tokens + r.decode_tokens <= 32 for r in eng.history)
    assert sum(1 for r in prefill_iters if r.decode_tokens) >= 5  # decoding went on meanwhile
    assert got[-1].token_ids == _alone(tiny, long.prompt, 4)
    # without chunking the whole prompt is one iteration
    eng2 = BatchEngine(tiny, proposer="none", token_budget=32, chunked=False)
    _serve_all(eng2, [long])
    assert max(r.prefill_tokens for r in eng2.history) == len(long.prompt) - 1


def test_a_chat_turn_behind_a_long_prompt_is_answered_before_it_is(tiny):
    """A short prompt that arrives while a long one is being prefilled in chunks gets its
    first token long before the long one (it used to wait for the whole long prefill); the
    long one keeps moving meanwhile, and both answers are the ones served alone."""
    eng = BatchEngine(tiny, proposer="none", token_budget=16, max_active=4)
    first_at: dict[str, int] = {}
    done: dict[str, tuple[int, ...]] = {}

    def watch(name):
        def emit(ev):
            if isinstance(ev, TokensCommitted) and ev.tokens:
                first_at.setdefault(name, eng.iterations)
            elif isinstance(ev, Finished):
                done[name] = ev.token_ids
        return emit

    long = tuple(int(t) for t in np.arange(600) % tiny.vocab_size)
    chat = _prompts(tiny.vocab_size, 1, 12, 40, 41)[0]
    eng.submit(EngineRequest(long, GREEDY, 4), watch("long"))
    for _ in range(5):
        eng.step()  # 5 chunks of the long prompt
    long_before = [r.prefill_tokens for r in eng.history]
    eng.submit(EngineRequest(chat, GREEDY, 4), watch("chat"))
    eng.run_until_idle()
    assert first_at["chat"] < first_at["long"] - 10
    shared = [r for r in list(eng.history)[len(long_before):] if r.prefill_tokens]
    assert all(r.prefill_tokens <= 16 for r in shared)
    assert done["chat"] == _alone(tiny, chat, 4) and done["long"] == _alone(tiny, long, 4)


def _tree(rng, vocab: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Tokens and parents of a random tree of n nodes (node 0 the root)."""
    parents = (-1, *(int(rng.integers(0, i)) for i in range(1, n)))
    return tuple(int(t) for t in rng.integers(0, vocab, n)), parents


@pytest.mark.parametrize("tree_nodes", [6, 25])  # attends with the chains | alone (> 16)
def test_flat_forward_trees_match_the_single_session_tree_forward(tiny, tree_nodes):
    """A tree segment beside chain segments: its logits are the single-session tree forward's
    (per-node positions, ancestor mask), and keep_paths leaves the row as compact_cache
    leaves the verifier: the next block's logits agree too."""
    from macfleet.engine.tree import TokenTree, depths_of
    from macfleet.engine.tree_verify import compact_cache, tree_forward

    m = tiny.model
    rng = np.random.default_rng(7)
    prompts = _prompts(tiny.vocab_size, 3, seed=8, lo=20, hi=40)
    store = BatchKV(len(m.layers))
    caches = [store.open() for _ in prompts]
    flat_forward(m, [Segment(p[:-1], c, None) for p, c in zip(prompts, caches)])
    toks, parents = _tree(rng, tiny.vocab_size, tree_nodes)
    toks = (prompts[1][-1], *toks[1:])
    segs = [Segment((prompts[0][-1], 3, 4), caches[0]), Segment(toks, caches[1], 0, parents),
            Segment((prompts[2][-1],), caches[2])]
    out = flat_forward(m, segs)
    v = Verifier(m)
    v.prefill(prompts[1][:-1])
    tree = TokenTree(list(toks), list(parents), depths_of(parents), [], [], [])
    ref = np.array(tree_forward(v, tree))
    np.testing.assert_allclose(np.array(out[1]), ref, rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    # keep the path root -> deepest node's ancestors (not nodes 1..m: a real move)
    leaf = max(range(len(parents)), key=lambda i: (tree.depths[i], i))
    path = []
    while leaf > 0:
        path.append(leaf)
        leaf = parents[leaf]
    path = path[::-1]
    base = len(prompts[1]) - 1
    store.keep_paths([(caches[1], base, path)])
    compact_cache(v, base, path)
    assert caches[1].offset == v.offset == base + 1 + len(path)
    nxt = (5, 6)
    out2 = flat_forward(m, [Segment(nxt, caches[1])])
    np.testing.assert_allclose(np.array(out2[0]), np.array(v.forward(nxt)), rtol=LOGIT_RTOL,
                               atol=LOGIT_ATOL)


def test_a_chat_turn_joining_decoders_is_chunked_by_the_stall_control(tiny, monkeypatch):
    """A prompt shorter than the token budget goes in at once when nobody decodes, but in
    stall-control chunks (the first one MIN_PREFILL_CHUNK tokens, when no verify(L) table of
    this machine is known and nothing is measured yet) when it joins a decoding session;
    stall_ratio 0 turns that off. Its ids do not change."""
    import macfleet.engine.verify_costs as vc
    from macfleet.serve.scheduler import MIN_PREFILL_CHUNK

    monkeypatch.setattr(vc, "known_verify_costs", lambda model, **kw: None)

    first, turn = _prompts(tiny.vocab_size, 2, 11, 60, 61)

    def run(**kw):
        eng, out = BatchEngine(tiny, proposer="none", **kw), {}
        eng.submit(EngineRequest(first, GREEDY, 30), lambda ev: None)
        eng.step()
        eng.step()  # the first session decodes
        eng.submit(EngineRequest(turn, GREEDY, 8),
                   lambda ev: isinstance(ev, Finished) and out.__setitem__("ids", ev.token_ids))
        eng.run_until_idle()
        return [r.prefill_tokens for r in eng.history if r.prefill_tokens][1:], out["ids"]

    chunks, ids = run()
    assert chunks[0] == MIN_PREFILL_CHUNK and len(chunks) >= 2 and sum(chunks) == len(turn) - 1
    assert ids == _alone(tiny, turn, 8)
    at_once, ids0 = run(stall_ratio=0.0)
    assert at_once == [len(turn) - 1] and ids0 == ids


def test_a_known_verify_curve_sizes_the_first_chunk(tiny, monkeypatch):
    """With this machine's verify(L) table known, the first chunk is read off it: the
    largest one whose iteration it prices within the stall ratio (here 1 decoder + 17 chunk
    tokens: 15 ms of the 1.5 x 10 ms allowed). Its ids do not change."""
    import macfleet.engine.verify_costs as vc

    table = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 40.0}
    monkeypatch.setattr(vc, "known_verify_costs", lambda model, **kw: table)
    first, turn = _prompts(tiny.vocab_size, 2, 11, 60, 61)
    eng, out = BatchEngine(tiny, proposer="none", stall_ratio=1.5), {}
    eng.submit(EngineRequest(first, GREEDY, 30), lambda ev: None)
    eng.step()
    eng.step()
    eng.submit(EngineRequest(turn, GREEDY, 8),
               lambda ev: isinstance(ev, Finished) and out.__setitem__("ids", ev.token_ids))
    eng.run_until_idle()
    chunks = [r.prefill_tokens for r in eng.history if r.prefill_tokens][1:]
    assert chunks[0] == 17 and sum(chunks) == len(turn) - 1
    assert out["ids"] == _alone(tiny, turn, 8)


def test_drafts_and_a_prompt_chunk_share_one_stall_allowance(tiny, monkeypatch):
    """A decoder drafting while a chat turn prefills: the iteration's drafts and chunk together
    stay within the stall ratio x one token per decoder (here every forward costs what a linear
    verify(L) table says, 10 + n/2 ms, on the engine's clock: 1 decoder, ratio 1.5 -> 11
    tokens). Bounded one after the other they compounded: a block of up to 5 tokens, then a
    chunk priced against the block's cost (up to 17 tokens, 1.75x). The prompt goes first
    (automatic draft lengths; a fixed `--draft-tokens K` is the user's and rides on top);
    ids do not change."""
    import macfleet.engine.verify_costs as vc
    import macfleet.serve.engine as engine_mod

    table = {n: 10.0 + n / 2 for n in (1, 2, 4, 8, 16, 32, 64, 128)}
    monkeypatch.setattr(vc, "known_verify_costs", lambda model, **kw: table)
    monkeypatch.setattr(engine_mod, "verify_costs", lambda model, **kw: table)
    now = [0.0]
    real_forward = engine_mod.flat_outputs

    def priced_forward(model, segs, **kw):  # the forward takes the table's time
        now[0] += (10.0 + sum(len(sg) for sg in segs) / 2) / 1e3
        return real_forward(model, segs, **kw)

    monkeypatch.setattr(engine_mod, "flat_outputs", priced_forward)
    pattern = tuple(range(40, 48))
    first, turn = pattern * 6, _prompts(tiny.vocab_size, 2, 11, 60, 61)[1]
    eng = BatchEngine(tiny, proposer="ngram", stall_ratio=1.5, clock=lambda: now[0])
    out = {}
    eng.submit(EngineRequest(first, GREEDY, 40), lambda ev: None)
    for _ in range(3):
        eng.step()  # the first session decodes, drafting
    assert any(r.decode_tokens > 1 for r in eng.history)  # it drafts: the test can fail
    eng.submit(EngineRequest(turn, GREEDY, 8),
               lambda ev: isinstance(ev, Finished) and out.__setitem__("ids", ev.token_ids))
    eng.run_until_idle()
    mixed = [r for r in eng.history if r.prefill_tokens and r.decode_tokens]
    assert mixed and all(r.decode_tokens + r.prefill_tokens <= 11 for r in mixed), mixed
    assert out["ids"] == _alone(tiny, turn, 8)


def test_cancel_frees_the_session_and_others_finish(tiny):
    eng = BatchEngine(tiny, proposer="none")
    events: list = []
    closed: list[int] = []
    h = eng.submit(EngineRequest((1, 2, 3), GREEDY, 200), events.append,
                   lambda: closed.append(1))
    other: list = []
    eng.submit(EngineRequest((4, 5, 6), GREEDY, 5), other.append)
    for _ in range(3):
        eng.step()
    assert eng.kv_store.open_rows == 2
    h.cancel()
    eng.step()
    assert eng.kv_store.open_rows == 1  # its KV row is free at the next iteration
    eng.run_until_idle()
    assert closed == [1] and eng.load() == (0, 0) and eng.kv_store.open_rows == 0
    assert not any(isinstance(e, Finished) for e in events)  # nobody to tell
    assert isinstance(other[-1], Finished) and len(other[-1].token_ids) == 5


def test_a_session_that_cannot_start_fails_alone(tiny, monkeypatch):
    """One bad request must not take the engine down (a seed numpy refused once killed the
    engine thread: every later request got 503)."""
    import macfleet.serve.engine as engine_mod

    real = engine_mod.make_rng

    def picky(params, stream=0):
        if params.seed == 13:
            raise ValueError("refused seed")
        return real(params, stream)

    monkeypatch.setattr(engine_mod, "make_rng", picky)
    eng = BatchEngine(tiny, proposer="none")
    bad: list = []
    good: list = []
    eng.submit(EngineRequest((1, 2), SamplingParams(0.5, 1.0, 13), 4), bad.append)
    eng.submit(EngineRequest((3, 4), GREEDY, 4), good.append)
    eng.run_until_idle()
    assert isinstance(bad[-1], SessionFailed) and "refused seed" in bad[-1].message
    assert isinstance(good[-1], Finished) and len(good[-1].token_ids) == 4
    assert eng.load() == (0, 0)


def test_queue_limit_and_zero_tokens(tiny):
    eng = BatchEngine(tiny, proposer="none", max_queue=2)
    out: list = []
    eng.submit(EngineRequest((1, 2), GREEDY, 0), out.append)
    eng.submit(EngineRequest((1, 2), GREEDY, 1), out.append)
    with pytest.raises(Overloaded):
        eng.submit(EngineRequest((1, 2), GREEDY, 1), out.append)
    eng.run_until_idle()
    fins = [e for e in out if isinstance(e, Finished)]
    assert sorted(len(f.token_ids) for f in fins) == [0, 1]
    assert not any(isinstance(e, SessionFailed) for e in out)


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_alone(smollm2):
    """The embedded model, 4 chat prompts at once vs one by one (same ids as
    `macfleet generate --local --proposer none`, whose loop `_alone` runs). 10 tokens each
    (16 until the suite was cut: the references decoded alone were most of its time): the
    first answer still ends at its EOS (7 tokens) while the others decode on."""
    tok = smollm2.tokenizer
    qs = ["What is the capital of France?", "Write a haiku about rain.",
          "Explain what a CPU does in one sentence.", "What is 12 times 12?"]
    prompts = [tuple(tok.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)) for q in qs]
    reqs = [EngineRequest(p, GREEDY, 10, smollm2.eos_ids) for p in prompts]
    got = _serve_all(BatchEngine(smollm2, proposer="ngram", token_budget=256), reqs)
    for r, f in zip(reqs, got):
        assert f.token_ids == _alone(smollm2, r.prompt, 10)
    assert sorted(len(f.token_ids) for f in got)[:2] == [7, 10]  # one left the batch early


def test_shared_prompt_prefixes_are_copied_and_answers_do_not_change(tiny):
    """Prompts with a common system turn (and a repeated question) take their prefix from
    another session's cache instead of prefilling it; every answer is still the alone one."""
    rng = np.random.default_rng(5)
    system = tuple(rng.integers(0, tiny.vocab_size, 30).tolist())
    asks = [tuple(rng.integers(0, tiny.vocab_size, int(rng.integers(3, 12))).tolist())
            for _ in range(4)]
    prompts = [system + asks[i % 4] for i in range(8)]  # 8 sessions, each question twice
    reqs = [EngineRequest(p, GREEDY, 10) for p in prompts]
    eng = BatchEngine(tiny, proposer="none", token_budget=64)
    got = _serve_all(eng, reqs)
    for r, f in zip(reqs, got):
        assert f.token_ids == _alone(tiny, r.prompt, r.max_tokens)
    fed = sum(rec.prefill_tokens for rec in eng.history)
    assert fed < sum(len(p) - 1 for p in prompts) - 6 * 30  # the system turn prefilled ~once
    assert eng.load() == (0, 0) and eng.kv_store.open_rows == 0  # every row freed


def test_batch_kv_rows_copy_and_roll_back(tiny):
    m = tiny.model
    store = BatchKV(len(m.layers), step=8)
    a, b = store.open(), store.open()
    p = tuple(range(1, 21))
    flat_forward(m, [Segment(p, a, None)])
    store.copy_prefixes([(a, b, 12)])
    assert b.offset == 12
    for i in range(len(m.layers)):
        np.testing.assert_array_equal(np.array(store.keys[i][b.row, :, :12]),
                                      np.array(store.keys[i][a.row, :, :12]))
    # b continues from the copied prefix: same logits as computing it itself
    out_b = flat_forward(m, [Segment(p[12:15], b, 0)])[0]
    ref = Verifier(m)
    ref.prefill(p[:12])
    np.testing.assert_allclose(np.array(out_b), np.array(ref.forward(p[12:15])),
                               rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    b.trim(3)
    assert b.offset == 12 and store.capacity == 24 and store.rows >= 2
    a.close()
    b.close()
    assert store.open_rows == 0 and store.state == []  # idle: memory given back


@pytest.mark.slow
def test_a_long_prompt_keeps_its_kv_apart_and_answers_do_not_change(tiny):
    """A prompt past OWN_STORE_PROMPT gets a store of its own (growing the shared one would copy
    every row); its rows attend alone, the short sessions' together, in the same forwards."""
    from macfleet.serve.engine import OWN_STORE_PROMPT

    eng = BatchEngine(tiny, proposer="none", token_budget=64, max_active=4)
    short = [EngineRequest(p, GREEDY, 24) for p in _prompts(tiny.vocab_size, 3, 9, 4, 20)]
    long = EngineRequest(tuple(np.arange(OWN_STORE_PROMPT + 88) % tiny.vocab_size), GREEDY, 6)
    caps: list[int] = []
    real_step = eng.step

    def step(*a):
        out = real_step(*a)
        caps.append(eng.kv_store.capacity)
        return out

    eng.step = step
    got = _serve_all(eng, [*short, long])
    for r, f in zip([*short, long], got):
        assert f.token_ids == _alone(tiny, r.prompt, r.max_tokens)
    assert max(caps) <= 256  # the shared store never grew for the long prompt
    assert sum(1 for r in eng.history if r.prefill_tokens and r.decode_tokens) >= 3


def test_cap_total_cuts_the_largest_draft_lengths_first():
    from macfleet.engine.proposers.group import cap_total

    assert cap_total([24, 0], 5) == [5, 0]
    assert cap_total([4, 4, 2], 6) == [2, 2, 2]
    assert cap_total([3, 1], 10) == [3, 1] and cap_total([3, 1], 0) == [0, 0]


# --- issue 36: the batch's KV rollback, pinned without a model (mutation testing) ---------------


def _filled_store(rows: int, capacity: int, layers: int = 2, heads: int = 2, dim: int = 3):
    """A BatchKV whose key at (layer, row, head, position) is 1000*layer + 100*row + 10*head +
    position (+ 0.5 for each dim index) and whose value is its negative."""
    import mlx.core as mx

    store = BatchKV(layers, step=8)
    caches = [store.open() for _ in range(rows)]
    store.rows, store.capacity = rows, capacity
    grid = np.meshgrid(np.arange(rows), np.arange(heads), np.arange(capacity), np.arange(dim),
                       indexing="ij")
    for i in range(layers):
        k = 1000.0 * i + 100 * grid[0] + 10 * grid[1] + grid[2] + 0.5 * grid[3]
        store.keys[i], store.values[i] = mx.array(k, dtype=mx.float32), mx.array(-k, mx.float32)
    return store, caches


def test_keep_paths_moves_each_rows_kept_nodes_behind_its_root_in_one_call():
    store, (a, b, c) = _filled_store(3, 16)
    before = [(np.array(k), np.array(v)) for k, v in zip(store.keys, store.values)]
    a.offset, b.offset, c.offset = 10, 12, 5
    # a: nodes 1, 2 are already behind the root (no move); b: nodes 2 and 5 move to 4, 5;
    # c: nothing kept past its root
    store.keep_paths([(a, 4, [1, 2]), (b, 3, [2, 5]), (c, 0, [])])
    assert (a.offset, b.offset, c.offset) == (7, 6, 1)
    for (k0, v0), k, v in zip(before, store.keys, store.values):
        k, v = np.array(k), np.array(v)
        want = k0.copy()
        want[1, :, 4], want[1, :, 5] = k0[1, :, 5], k0[1, :, 8]
        assert np.array_equal(k, want) and np.array_equal(v, -want)
    with pytest.raises(ValueError, match="cannot keep 2 nodes past 4"):
        store.keep_paths([(b, 4, [1, 2])])  # b holds 6: 4 + 1 + 2 > 6
    store.keep_paths([(b, 3, [1, 2])])  # exactly what it holds
    assert b.offset == 6
    other, (d,) = _filled_store(1, 16)
    d.offset = 8
    with pytest.raises(ValueError, match="row 0: cannot keep 1 nodes past 2"):
        store.keep_paths([(d, 2, [1])])  # another store's row
    assert d.offset == 8
    one, (r,) = _filled_store(1, 8, layers=1)  # a one-layer model's store
    k0 = np.array(one.keys[0])
    r.offset = 4
    one.keep_paths([(r, 0, [2])])
    assert r.offset == 2 and np.array_equal(np.array(one.keys[0])[0, :, 1], k0[0, :, 2])


def test_a_row_rolls_back_at_most_what_it_holds_and_says_how_much(tiny):
    from macfleet.engine.batch import trim_cache

    store, (a,) = _filled_store(1, 16)
    a.offset = 10
    assert a.trim(3) == 3 and a.offset == 7
    assert a.trim(0) == 0 and a.offset == 7
    assert a.trim(100) == 7 and a.offset == 0
    a.offset = 9
    trim_cache(a, 4)
    assert a.offset == 5
    v = Verifier(tiny.model)
    v.prefill(list(range(1, 13)))
    trim_cache(v.cache, 5)
    assert [c.offset for c in v.cache] == [7] * len(v.cache)
