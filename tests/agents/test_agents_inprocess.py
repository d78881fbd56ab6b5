"""Agents in one process on tiny models: fast checks of the role services over real sockets.

Token ids: the "greedy margin" rule of tests/tolerance.py for remote drafting vs the
verifier alone; "same path" for a seeded request asked twice of the same agents.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from agents.daemon import Agent, AgentConfig
from agents.draft_stream import DraftStream
from agents.proposer_service import ProposerLimits
from agents.remote_proposer import RemoteProposer
from bridge.errors import BAD_REQUEST, ProtocolError
from macfleet.cli.common import UserError, parse_draft_tokens
from macfleet.engine.controller import MAX_DRAFT_TOKENS
from macfleet.engine.models import load_model
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import ProposerFailed
from remote_gen import generate_done

KEY = b"k" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
MODEL = "tiny:3"


@pytest.fixture(scope="module")
def pair():
    prop = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    ver = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                            allow_peers=LOCAL,
                            f3_probe=True))
    yield ver, prop
    ver.close()
    prop.close()


def eagle_proposer_agent(tmp_path, seed: int) -> Agent:
    """A proposer agent whose heads directory holds a random EAGLE head (head.safetensors)."""
    import mlx.core as mx

    from macfleet.distill.heads import config_for_verifier, save_head
    from macfleet.engine.proposers.eagle.head import EagleHead

    lm = load_model(MODEL)
    mx.random.seed(seed)
    save_head(EagleHead(config_for_verifier(lm.model, MODEL, feature_scale=1.0), lm.model),
              tmp_path / "head")
    return Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL,
                             heads_dir=str(tmp_path)))


def gen(ver, prop, spec, **kw):
    """prop: an Agent, a list of endpoints, or None (the verifier alone)."""
    eps = prop if isinstance(prop, list) else [prop.card.router_endpoint] if prop else []
    return generate_done(ver.card, KEY, "the cat sat on the mat", eps, spec, **kw)


# the fast lane keeps draft:tiny:4, a drafter the verifier disagrees with (rejections, rollback
# over the wire); the others run in the default suite (docs/testing.md "Fast lane, second round")
@pytest.mark.slow
@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.slow) for s in (
    "draft:tiny:3", "layerskip:2", "ngram")] + ["draft:tiny:4"])
def test_remote_greedy_equals_verifier_alone(pair, spec):
    ver, prop = pair
    alone = gen(ver, None, "none", max_tokens=40)
    for cross in (False, True):
        d = gen(ver, prop, spec, max_tokens=40, draft_tokens=3, cross_round=cross)
        assert d.token_ids == alone.token_ids, (spec, cross)
        assert d.stats.fleet.flows.remote_blocks > 0


@pytest.mark.slow
def test_cross_round_predrafts_hit_when_drafts_are_right(pair):
    """Self-drafting accepts everything, and the proposer's guess of the bonus token is the
    verifier's own: the next block is ready before it is asked for."""
    ver, prop = pair
    no = gen(ver, prop, "draft:tiny:3", max_tokens=40, draft_tokens=3, cross_round=False)
    yes = gen(ver, prop, "draft:tiny:3", max_tokens=40, draft_tokens=3, cross_round=True)
    assert no.stats.acceptance == 1.0 and yes.stats.acceptance == 1.0
    assert no.stats.fleet.flows.predraft_hit_rate == 0.0
    assert yes.stats.fleet.flows.predraft_hit_rate > 0.5


def test_f3_probe_is_measured_per_block(pair):
    ver, prop = pair
    # Observed, not raced: the verifier does not wait for the proposer's session to open (its
    # blocks decode plainly meanwhile), and on a loaded box 12 tokens can end first (no block
    # drafted remotely, no F3 measured: once in a loaded fast-lane run): a few tries.
    for _ in range(5):
        d = gen(ver, prop, "ngram", max_tokens=12, draft_tokens=2)
        if d.stats.fleet.flows.remote_blocks > 0:
            break
    hidden = load_model(MODEL).hidden_size
    assert d.stats.fleet.flows.f3_probe is True
    assert d.stats.fleet.flows.f3_bytes_per_block >= hidden * 2  # at least one float16 row
    assert d.stats.fleet.flows.f3_ms_per_block > 0


@pytest.mark.slow
def test_sampling_remote_is_seeded_and_lossless_path_runs(pair):
    ver, prop = pair
    # without cross-round pre-drafts: a pre-draft is used or dropped by timing, and the ratio
    # test's draws depend on the drafts it is given (the output's distribution does not), so a
    # seed reproduces a sampled answer where the drafts are reproducible (2 of 4 runs differed
    # with pre-drafts on, at this session's start commit too)
    a, b = (gen(ver, prop, "draft:tiny:4", max_tokens=20, temperature=1.0, seed=5,
                draft_tokens=3, cross_round=False) for _ in range(2))
    assert a.token_ids == b.token_ids
    # draft probabilities travelled as frames
    assert a.stats.fleet.flows.f2_bytes_per_block > 64 * 4


def test_draft_stream_keeps_only_a_surviving_prefix():
    lm = load_model(MODEL)
    s = DraftStream(make_proposer("draft:tiny:3", lm), [1, 2, 3], want_probs=False,
                    cross_round=True)
    s.proposer.start(__import__("macfleet.engine.sampling", fromlist=["x"]).GREEDY)
    r = s.draft(3)
    assert len(r.tokens) == 3 and not r.predraft_hit
    s.extend(4)
    stream = list(s.stream)
    assert s.commit(stream[:4])  # all 3 accepted + the bonus guess: the rest survives
    assert s.stream == stream[4:]
    assert s.draft(len(s.stream) + 2).predraft_hit  # partly pre-drafted still counts
    bad = (s.stream[0] + 1) % lm.vocab_size
    assert not s.commit([bad]) and s.stream == []


@pytest.mark.slow
def test_remote_tree_of_two_proposer_agents_is_lossless_and_survives_one_dying(pair):
    ver, prop = pair
    prop2 = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                              allow_peers=LOCAL))
    try:
        alone = gen(ver, None, "none", max_tokens=40)
        eps = [prop.card.router_endpoint, prop2.card.router_endpoint]
        done = gen(ver, eps, "ngram+draft:tiny:3", max_tokens=40, draft_tokens=3)
        assert done.token_ids == alone.token_ids
        assert done.stats.acceptance_of("draft:tiny:3@" + eps[1]) == 1.0
        prop2.close()  # gone: the tree loses a branch, the session goes on
        done2 = gen(ver, eps, "ngram+draft:tiny:3", max_tokens=40, draft_tokens=3)
        assert done2.token_ids == alone.token_ids and done2.stats.fleet.proposer_failures == 1
    finally:
        prop2.close()


@pytest.mark.slow
def test_remote_eagle_gets_real_hidden_states_over_f3(pair, tmp_path):
    """A hidden-state drafter on the proposer agent is fed the verifier's own hidden states
    (flow F3, riding with each draft request; the rows of its session in the verifier's
    continuous batch): lossless, and the proposer never recomputes features itself."""
    ver, _ = pair
    lm = load_model(MODEL)
    prop = eagle_proposer_agent(tmp_path, seed=0)
    try:
        alone = gen(ver, None, "none", max_tokens=30)
        before = ver.verifier.batch_view().iterations
        d = gen(ver, prop, "eagle:head.safetensors", max_tokens=30, draft_tokens=3)
        # verified in the continuous batch: the engine fed the session's rows to F3
        assert ver.verifier.batch_view().iterations > before
        drafts = ver.verifier.generations.drafts
        drafts.f3_codec = "int8"  # hidden states as int8 + row scales: still lossless
        d8 = gen(ver, prop, "eagle:head.safetensors", max_tokens=30, draft_tokens=3)
        drafts.f3_codec = "float16"
        assert d8.token_ids == alone.token_ids
        assert (d8.stats.fleet.flows.f3_bytes_per_block
                < 0.6 * d.stats.fleet.flows.f3_bytes_per_block)
        for bad in ("eagle:../../etc/passwd", "draft:/etc/passwd"):
            # refused -> plain decoding (a fixed draft length: the batch asks at once, where
            # the auto controller may wait to draft until drafts would pay)
            refused = gen(ver, prop, bad, max_tokens=4, draft_tokens=2)
            assert refused.stats.fleet.proposer_failures == 1
        fallback = prop.proposer.fallback_tokens
    finally:
        prop.close()
    assert d.token_ids == alone.token_ids
    # >= one float16 row a block
    assert d.stats.fleet.flows.f3_bytes_per_block >= lm.hidden_size * 2
    assert d.stats.fleet.flows.remote_blocks > 0 and fallback == 0  # every feature over F3


@pytest.mark.slow
def test_remote_eagle_chains_of_batched_sessions_are_drafted_together(pair, tmp_path,
                                                                     monkeypatch):
    """Four sessions in the verifier's continuous batch, each drafted by the EAGLE head on the
    proposer agent: their requests of a round arrive together and are drafted in one
    `draft_chains` call; the prompts' common prefix is copied between their caches with the
    hidden rows their F3 feeds need; every answer equals the verifier alone's."""
    import agents.proposer_chains as chains
    from macfleet.serve import engine as serve_engine

    copies, calls = [], []
    real_copy, real_draft = serve_engine.copy_features, chains.draft_together

    def spy(src, dst, n):
        ok = real_copy(src, dst, n)
        copies.append((n, ok, bool(dst.feeds)))
        return ok

    monkeypatch.setattr(serve_engine, "copy_features", spy)
    monkeypatch.setattr(chains, "draft_together",
                        lambda jobs, *a: calls.append(len(jobs)) or real_draft(jobs, *a))

    ver, _ = pair
    prop = eagle_proposer_agent(tmp_path, seed=1)
    preamble = "you are a helpful assistant and you answer in short plain words. "
    prompts = [preamble + p for p in ("the cat sat on the mat", "a dog ran in the park",
                                      "one two three four", "the sun is hot today")]
    eps = [prop.card.router_endpoint]
    try:
        alone = [generate_done(ver.card, KEY, p, [], "none", max_tokens=24) for p in prompts]
        got: dict[int, object] = {}

        def one(i):
            got[i] = generate_done(ver.card, KEY, prompts[i], eps, "eagle:head.safetensors",
                                   max_tokens=24, draft_tokens=3)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        prop.close()
    assert [got[i].token_ids for i in range(len(prompts))] == [a.token_ids for a in alone]
    assert all(got[i].stats.fleet.flows.remote_blocks > 0 for i in range(len(prompts)))
    assert max(calls) > 1  # some rounds drafted several sessions in one call
    # sessions fed over F3 shared the preamble, rows included (they prefilled it each before)
    assert copies and all(ok and fed for _, ok, fed in copies)


@pytest.mark.slow  # trains a head first
def test_remote_eagle2_drafts_dynamic_trees_over_the_wire(tmp_path, monkeypatch):
    """An EAGLE-2 drafter on the proposer agent returns a token tree (DraftReply.parents); the
    verifier agent verifies it in one forward: output identical to the verifier alone, fed by
    F3, never recomputing features. (tiny:1:16: a verifier a head learns in seconds.)"""
    import mlx.core as mx
    from eagle_fixtures import _greedy_text

    from macfleet.distill.heads import config_for_verifier, extract_features, save_head
    from macfleet.engine.proposers.eagle.head import EagleHead
    from macfleet.distill.train import TrainParams, feature_rms, train

    import reference_loops as tree_loop

    # the tiny verifier costs what its head does, so measured costs would (rightly) stop the
    # remote drafter from drafting at all; verify as if it were a big model's step (the
    # verifier agent sends this table to the drafter, which sizes its trees against it)
    import macfleet.serve.engine as batch_engine

    costly = {1: 100.0, 16: 105.0, 32: 120.0}
    monkeypatch.setattr(tree_loop, "verify_costs", lambda m: costly)  # one session at a time
    monkeypatch.setattr(batch_engine, "verify_costs", lambda m: costly)  # the agent's batch
    model = "tiny:1:16"
    lm = load_model(model)
    # the training text of tests/eagle_fixtures.py (the same ids as generate_step's, one batch)
    chunks = extract_features(lm.model, _greedy_text(lm, 40, 120), chunk=128)
    mx.random.seed(0)
    head = EagleHead(config_for_verifier(lm.model, model, feature_scale=feature_rms(chunks)),
                     lm.model)
    # 100 steps: as the eagle tests' `trained` head (tests/engine/proposers/eagle/conftest.py:
    # the same held-out acceptance as 200 gave, in half the time)
    train(head, chunks, TrainParams(steps=100, batch=8, seq_len=64, lr=3e-3, save_every=10**6))
    save_head(head, tmp_path / "head")
    ver = Agent(AgentConfig(role="verifier", model=model, key=KEY, advertise=False,
                            allow_peers=LOCAL))
    prop = Agent(AgentConfig(role="proposer", model=model, key=KEY, advertise=False,
                             allow_peers=LOCAL,
                             heads_dir=str(tmp_path)))
    try:
        alone = gen(ver, None, "none", max_tokens=40)
        d = gen(ver, prop, "eagle2:head.safetensors", max_tokens=40)
        fallback = prop.proposer.fallback_tokens
    finally:
        prop.close()
        ver.close()
    assert d.token_ids == alone.token_ids
    assert d.stats.drafted > 0
    # the head's own trees: 15 accepted in 25 blocks (the same under two busy loops); drafts
    # shifted by one token (a tree's tokens not the head's) kept 5 in 35
    assert d.stats.accepted >= d.stats.blocks / 3, (d.stats.accepted, d.stats.blocks)
    assert d.stats.blocks < 40
    assert fallback == 0


def test_the_longest_draft_the_cli_accepts_is_drafted_remotely(pair):
    """One draft-length limit for CLI, verifier and proposer agents: the longest length the CLI
    accepts is drafted by the proposer agent, not refused into plain decoding."""
    assert parse_draft_tokens(str(MAX_DRAFT_TOKENS)) == MAX_DRAFT_TOKENS
    with pytest.raises(UserError):
        parse_draft_tokens(str(MAX_DRAFT_TOKENS + 1))
    assert ProposerLimits().max_k == MAX_DRAFT_TOKENS
    ver, prop = pair
    alone = gen(ver, None, "none", max_tokens=40)
    d = gen(ver, prop, "draft:tiny:3", max_tokens=40, draft_tokens=MAX_DRAFT_TOKENS)
    assert d.token_ids == alone.token_ids
    assert d.stats.fleet.proposer_failures == 0 and d.stats.fleet.flows.remote_blocks > 0
    with pytest.raises(ProtocolError) as e:
        gen(ver, prop, "draft:tiny:3", max_tokens=4, draft_tokens=MAX_DRAFT_TOKENS + 1)
    assert e.value.code == BAD_REQUEST


def test_the_verifier_agent_drafts_a_local_tree_like_generate_local(pair):
    """No endpoints: the agent's own drafters, tree or chain decided as in-process."""
    ver, _ = pair
    alone = gen(ver, None, "none", max_tokens=30)
    tree = gen(ver, None, "ngram+draft:tiny:3", max_tokens=30)
    assert tree.token_ids == alone.token_ids
    assert [p.name for p in tree.stats.per_proposer] == ["ngram:3", "draft:tiny:3"]
    assert tree.stats.acceptance_of("draft:tiny:3") == 1.0


def test_a_remote_tree_drafter_learns_what_the_verifier_measured():
    """The verifier's verify(L) table (first request) and the fate of each tree (later ones)
    reach the drafter on the other Mac, as they reach a local one; lies are dropped."""
    from agents.draft_stream import DraftStream
    from agents.proposer_service import _learn
    from bridge.messages import DraftRequest
    from macfleet.engine.proposers.base import Proposer

    class Spy(Proposer):
        drafts_trees = True

        def __init__(self):
            self.seen, self.costs = [], None

        def propose(self, context, k):
            raise AssertionError

        def seed_verify_costs(self, costs):
            self.costs = dict(costs)

        def observe(self, drafted, accepted, verify_ms, verified=None):
            self.seen.append((drafted, accepted, verify_ms, verified))

    p = Spy()
    s = DraftStream(p, [1, 2], want_probs=False, cross_round=False)
    req = dict(session_id="s", block=1, committed=[], k=8, want_probs=False)
    _learn(s, DraftRequest(**req, verify_lengths=[1, 16, -3], verify_costs_ms=[40.0, 70.0, 5.0]))
    assert p.costs == {1: 40.0, 16: 70.0} and p.seen == []  # nothing drafted yet to report
    s.last_drafted = 6
    _learn(s, DraftRequest(**req, last_accepted=2, last_verified=9, last_verify_ms=66.0))
    assert p.seen == [(6, 2, 66.0, 9)]
    _learn(s, DraftRequest(**req, last_accepted=7, last_verified=9, last_verify_ms=66.0))
    _learn(s, DraftRequest(**req, last_accepted=1, last_verified=9, last_verify_ms=-1.0))
    assert len(p.seen) == 1  # more accepted than drafted, or a negative time: not learnt


@contextmanager
def opens_held(prop: Agent):
    """The proposer agent answers OpenSession only once the yielded gate is set (its loop busy
    with a model load meanwhile); everything else as usual."""
    from bridge.messages import OpenSession

    svc, gate = prop.proposer, threading.Event()
    real = svc.handle

    def held(msg, reply):
        if isinstance(msg, OpenSession):
            gate.wait(10)
        return real(msg, reply)

    svc.handle = held
    try:
        yield gate
    finally:
        svc.handle = real
        gate.set()


def test_a_proposer_slow_to_open_its_session_does_not_hold_up_the_verifier(pair):
    """Until OpenSession is answered (a proposer agent loading a draft model), blocks go out
    without drafts; the first reply turns drafting on."""
    _, prop = pair
    rp = RemoteProposer(prop.card.router_endpoint, key=KEY, proposer="ngram", model=MODEL)
    with opens_held(prop) as gate:
        try:
            rp.start()
            ctx = [1, 2, 3, 1, 2, 3, 1, 2]
            t0 = time.monotonic()
            assert rp.propose(ctx, 3).tokens == ()  # not open yet: an empty draft, at once
            assert rp.propose(ctx + [3], 3).tokens == ()
            assert time.monotonic() - t0 < 5
            gate.set()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the next blocks find the session open
                if rp.propose(ctx + [3, 1, 2], 3).tokens:
                    break
            assert rp._session and rp.flows.blocks > 0
        finally:
            rp.close()


def test_a_session_never_opened_or_refused_fails_the_proposer(pair):
    _, prop = pair
    rp = RemoteProposer(prop.card.router_endpoint, key=KEY, proposer="ngram", model=MODEL,
                        open_timeout_s=0.3)
    with opens_held(prop):
        try:
            rp.start()
            with pytest.raises(ProposerFailed, match="no answer within"):
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    assert rp.propose([1, 2, 3, 1, 2], 3).tokens == ()
                    time.sleep(0.05)
        finally:
            rp.close()
    bad = RemoteProposer(prop.card.router_endpoint, key=KEY,
                         proposer="draft:/no/such/model.gguf", model=MODEL)
    try:
        bad.start()
        with pytest.raises(ProposerFailed, match="cannot open"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                bad.propose([1, 2, 3], 3)
    finally:
        bad.close()


class _TreeEcho:
    """A host tree drafter for DraftStream tests: under the context's last token t, a branch
    t+1, t+2, ... of depth 3 and a one-node branch t+5 (ids mod 64)."""

    drafts_trees, wants_features, fallback_tokens = True, False, 0
    calls: list[int]

    def __init__(self):
        self.calls = []

    def propose(self, context, k):
        from macfleet.engine.proposers.base import Draft

        self.calls.append(len(context))
        t = context[-1]
        return Draft(tuple((t + d) % 64 for d in (1, 2, 3, 5))[:k], parents=(-1, 0, 1, -1)[:k])


def test_a_tree_session_drafts_its_next_tree_early_and_answers_from_it():
    p = _TreeEcho()
    s = DraftStream(p, [10], want_probs=False, cross_round=True)
    first = p.propose(s.context, 4)
    s.replied_tree(first)
    assert s.wants_lookahead()
    assert s.predraft_tree() and not s.wants_lookahead()  # once per reply
    assert p.calls[-1] == 1 + 3  # from the context + the deepest branch 11, 12, 13
    s.commit([11, 12, 13, 14])  # that branch accepted, bonus 14 = the early tree's guess
    got = s.take_tree(4)
    assert got is not None and got.tokens == (15, 16) and got.parents == (-1, 0)
    # the same length, another branch: no answer from the early tree
    s.replied_tree(p.propose(s.context, 4))
    s.predraft_tree()
    s.commit([15, 16, 99, 17])
    assert s.take_tree(4) is None


@pytest.mark.slow
def test_remote_retrieval_trees_are_drafted_ahead_and_lossless(tmp_path):
    """A tree drafter on another agent (the answer store) drafts each next tree while the
    verifier verifies: answers come from the early tree, the ids are the verifier's."""
    import numpy as np

    from macfleet.distill.dataset import save_store
    from macfleet.engine.proposers.retrieval import Datastore

    prop = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             heads_dir=str(tmp_path), allow_peers=LOCAL))
    ver = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                            allow_peers=LOCAL))
    try:
        alone = gen(ver, None, "none", max_tokens=60)
        prompt_ids = load_model(MODEL).tokenizer.encode("the cat sat on the mat")
        save_store(Datastore.build([list(prompt_ids) + list(alone.token_ids)]), tmp_path / "store")
        assert (tmp_path / "store.npy").is_file() or list(tmp_path.iterdir())
        done = gen(ver, prop, "retrieval:store", max_tokens=60, cross_round=True)
        assert done.token_ids == alone.token_ids
        assert done.stats.acceptance > 0.5
        assert done.stats.fleet.flows.predraft_hit_rate > 0.3
        off = gen(ver, prop, "retrieval:store", max_tokens=60, cross_round=False)
        assert off.token_ids == alone.token_ids
        assert off.stats.fleet.flows.predraft_hit_rate == 0.0
        assert np.isfinite(done.stats.acceptance)
    finally:
        ver.close()
        prop.close()
