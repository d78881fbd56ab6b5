"""The continuous-batching engine: one thread, one flat forward per iteration over every
active session's block or prefill chunk, each session accepting, rolling back and committing
on its own, so a request's greedy ids and seeded samples do not depend on its batch. It is the
one decode path (`generate --local` and the verifier agent run it with one request:
serve/one.py). `BatchEngine` wires the parts: docs/serving.md, "engine.py".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from macfleet.engine.batch import BatchKV, FlatOutputs, RowCache, Segment, flat_outputs
from macfleet.engine.constraint import Constraint, Grammar, bridge, grammar_error
from macfleet.engine.controller import AUTO, make_controller
from macfleet.engine.proposers.base import draft_together
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.base import Proposer
from macfleet.engine.proposers.prediction import PredictionProposer
from macfleet.engine.sampling import generation_seed, make_rng
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.engine.tree_verify import supports_tree_attention
from macfleet.engine.verifier import DEFAULT_PREFILL_STEP, Verifier
from macfleet.engine.verify_costs import verify_costs
from macfleet.fleet.batch import BatchView, IterationView, ServedSession
from macfleet.serve.batch_session import (BatchSession, BlockDraft,  # noqa: F401
                                          EngineEvent, EngineRequest, KVHandle, Overloaded,
                                          SessionFailed, SessionHandle, SessionStats)
from macfleet.serve.costs import BatchCosts
from macfleet.engine.batch_kv import ShippedKV
from macfleet.serve.decode import BlockStep, decisions, logprob_rows, read_iteration
from macfleet.serve.drafting import BatchDrafting, check_drafting, make_drafting
from macfleet.serve.lifecycle import Sessions
from macfleet.serve.logprobs import RowLogprobs
from macfleet.serve.prompt_cache import PromptCache
from macfleet.serve.scheduler import (DEFAULT_STALL_RATIO, DEFAULT_TOKEN_BUDGET, AheadView,
                                      IterationBudget, SessionView, Slot, iteration_budget,
                                      plan_iteration, steps_ahead)
from macfleet.serve.session_kv import (DEFAULT_DECODE_MS, OWN_STORE_PROMPT,  # noqa: F401
                                       SessionKV, copy_features)
from macfleet.serve.timing import TokenTimes

log = logging.getLogger(__name__)

DEFAULT_MAX_ACTIVE = 16
DEFAULT_MAX_QUEUE = 64
DEFAULT_IDLE_WAIT_S = 0.05
ITERATION_HISTORY = 256
DEFAULT_INSTALL_SHARE = 0.25  # of a decode-only iteration, spent installing a shipped KV


@dataclass(frozen=True)
class InFlight:
    """An iteration dispatched to the device and not read yet, with its lazy decisions and
    logprobs rows and when its time began (engine clock)."""

    run: tuple[tuple[BatchSession, Slot], ...]
    segs: tuple[Segment, ...]
    fwd: FlatOutputs
    decided: dict[int, mx.array]
    lps: dict[int, RowLogprobs]
    t0: float

    def of(self, live: list[BatchSession]) -> InFlight | None:
        """Only the slots of sessions still `live` (one cancelled meanwhile: its results are
        dropped; its forward still runs); None when none is."""
        keep = [i for i, (s, _) in enumerate(self.run) if s in live]
        if len(keep) == len(self.run):
            return self
        if not keep:
            return None
        f, sids = self.fwd, {self.run[i][0].sid for i in keep}
        return replace(self, run=tuple(self.run[i] for i in keep),
                       segs=tuple(self.segs[i] for i in keep),
                       fwd=FlatOutputs(tuple(f.logits[i] for i in keep),
                                       None if f.hidden is None
                                       else tuple(f.hidden[i] for i in keep), f.state),
                       decided={k: v for k, v in self.decided.items() if k in sids},
                       lps={k: v for k, v in self.lps.items() if k in sids})


class BatchEngine:
    """Runs every active session's blocks and prefill chunks in one forward per iteration."""


    @property
    def supports_prediction(self) -> bool:
        """EngineRequest.prediction honoured (a token tree: not in the batch-invariant mode)."""
        return not self.invariant

    def __init__(self, lm: LoadedModel, *, proposer: str = "ngram",
                 draft_tokens: int | str = "auto", token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_active: int = DEFAULT_MAX_ACTIVE, max_queue: int = DEFAULT_MAX_QUEUE,
                 chunked: bool = True, invariant: bool = False,
                 stall_ratio: float = DEFAULT_STALL_RATIO,
                 install_share: float = DEFAULT_INSTALL_SHARE,
                 clock: Callable[[], float] = time.perf_counter,
                 prompt_cache_bytes: int = 0, step_ahead: bool = True,
                 verifier: Verifier | None = None) -> None:
        """stall_ratio: an iteration with prefill chunks costs at most this many decode-only
        ones (0: only the token budget bounds it); install_share: the share of a decode-only
        iteration spent copying a shipped KV while others decode (0: all at once);
        prompt_cache_bytes: 0 for no prompt cache; step_ahead: dispatch plain steps one
        iteration ahead; verifier: every session runs through it, one at a time (a sharded
        verifier). docs/serving.md, "engine.py", says when the batch-invariant mode runs."""
        if verifier is not None and max_active != 1:
            raise ValueError("sessions on one verifier run one at a time (max_active=1)")
        self.lm, self.proposer_spec, self.draft_tokens = lm, proposer, draft_tokens
        self.invariant = (invariant or verifier is not None
                          or not supports_tree_attention(lm.model))
        probe = make_drafting(proposer, lm, draft_tokens, self.invariant)  # a spec this engine
        if probe is not None:  # cannot run fails here
            probe.close()
        self.token_budget, self.max_active, self.max_queue = token_budget, max_active, max_queue
        self.chunked, self.clock = chunked, clock
        self.install_share = install_share
        # this module's functions are looked up at each call: a test or a bench may replace them
        self.costs = BatchCosts(lm.model, stall_ratio, lambda m: verify_costs(m))
        self.prompt_cache = (PromptCache(prompt_cache_bytes)
                             if prompt_cache_bytes > 0 and not self.invariant else None)
        self.session_kv = SessionKV(
            lm.model, None if self.invariant else BatchKV(len(lm.model.layers)),
            self.prompt_cache, clock, verifier)
        self._vocab = lm.vocab_size
        self.table = Sessions(self.session_kv, clock, max_active=max_active,
                              max_queue=max_queue)
        self._cv = self.table.cv
        self.drafting = BatchDrafting(self._vocab, clock, self.costs,
                                      lambda jobs, clock: draft_together(jobs, clock))
        self.decode = BlockStep(clock, self.costs,
                                lambda s, reason: self.table.finish(s, reason=reason))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: deque[IterationView] = deque(maxlen=ITERATION_HISTORY)
        self.iterations = 0
        self.step_ahead = step_ahead and not self.invariant
        self._ahead: InFlight | None = None  # the next iteration, dispatched already
        self._lost: Exception | None = None  # the given verifier's failure, for its owner

    # -- the caller's side (any thread) -------------------------------------------------
    def start(self) -> BatchEngine:
        self._thread = threading.Thread(target=self._run, name="macfleet-batch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def kv_store(self) -> BatchKV | None:
        """The store whose rows are the sessions' KV caches (None: the batch-invariant mode's
        per-session caches; a long prompt's row is in a store of its own)."""
        return self.session_kv.kv_store

    def load(self) -> tuple[int, int]:
        """(active sessions, waiting sessions)."""
        return self.table.load()

    def sessions(self) -> list[ServedSession]:
        """Active, then waiting, then recently ended sessions (for /health and the dashboard)."""
        return self.table.views()

    def recent(self, n: int = 32) -> list[IterationView]:
        """The last n iterations (a copy: the engine thread keeps appending)."""
        with self._cv:
            return list(self.history)[-n:]

    def batch_view(self, model: str, n: int = 32) -> BatchView:
        """Load, the last n iterations and the sessions, for GET /v1/macfleet/batch."""
        active, waiting = self.load()
        pc = self.prompt_cache
        return BatchView(model=model, mode="batched", alive=self.alive, active=active,
                         waiting=waiting, iterations=self.iterations,
                         recent=tuple(self.recent(n)), sessions=tuple(self.sessions()),
                         prompt_cache=pc.stats() if pc is not None else None)

    def submit(self, req: EngineRequest, emit: Callable[[EngineEvent], None],
               on_close: Callable[[], None] | None = None, *,
               proposer: Proposer | ProposerGroup | None = None,
               shipped_kv: ShippedKV | None = None) -> SessionHandle:
        """Queue a request; `emit` gets its events on the engine thread, `on_close` is called
        once its session is gone. proposer: its own drafter (chain or group; None: one from
        the engine's spec), started and closed here; shipped_kv: prompt[:-1]'s KV computed
        elsewhere (flow KV), per layer (keys, values) [kv_heads, len(prompt) - 1, head_dim]."""
        if not req.prompt or not all(0 <= int(t) < self._vocab for t in req.prompt):
            raise ValueError(f"prompt must be 1+ token ids in 0..{self._vocab - 1}")
        if req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        if shipped_kv is not None and (len(shipped_kv) != len(self.lm.model.layers)
                                       or shipped_kv[0][0].shape[1] != len(req.prompt) - 1):
            raise ValueError("the shipped KV must cover every layer and prompt[:-1]")
        draft_tokens = req.draft_tokens if req.draft_tokens is not None else self.draft_tokens
        if tuple(req.prompt[len(req.prompt) - len(req.committed):]) != tuple(req.committed):
            raise ValueError("the committed answer tokens must end the prompt")
        # structured output (GrammarError, a ValueError, for a grammar or committed tokens)
        constraint = (Constraint(req.grammar, self.lm.tokenizer, self._vocab)
                      if req.grammar is not None else None)
        if constraint is not None and req.committed:
            constraint.resume(req.committed)
        if req.prediction:
            if self.invariant:
                raise ValueError("a prediction drafts a token tree; the batch-invariant mode "
                                 "verifies chains")
            if not all(0 <= int(t) < self._vocab for t in req.prediction):
                raise ValueError(f"prediction ids must be in 0..{self._vocab - 1}")
        if proposer is not None:
            check_drafting(proposer, self.invariant)
        drafting = (proposer if proposer is not None else
                    make_drafting(self.proposer_spec, self.lm, draft_tokens, self.invariant))
        predicting = (PredictionProposer(req.prediction, len(req.prompt) - len(req.committed))
                      if req.prediction else None)
        drafters = [d for d in (drafting, predicting) if d is not None]
        name = "+".join(d.name for d in drafters) or "none"
        group = drafting if isinstance(drafting, ProposerGroup) else None
        chain = None if group is not None else drafting
        feeds = [p for p in (group.proposers if group is not None else [chain])
                 if p is not None and p.wants_features]
        for p in feeds:  # the flat forward runs no tap: the engine feeds its features
            p.untap()
        for d in drafters:
            d.start(req.params)
        controller = make_controller(draft_tokens if chain is not None else 0)
        try:
            s = self.table.enqueue(lambda sid: BatchSession(
                sid, req, emit, chain, controller,
                KVHandle(len(req.prompt) - 1, shipped_kv), BlockDraft(),
                SessionStats(TokenTimes(self.clock())), group=group, feeds=feeds,
                auto_tree=group is not None and draft_tokens == AUTO, on_close=on_close,
                proposer_name=name, constraint=constraint, prediction=predicting))
        except Overloaded:
            for d in drafters:
                d.close()
            raise
        return SessionHandle(s, self._wake)

    def grammar_error(self, grammar: Grammar) -> str | None:
        """Why this model cannot follow `grammar` (None: it can). Builds the grammar engine's
        tokenizer on first use (seconds): callers run it off their event loop."""
        return grammar_error(grammar, bridge(self.lm.tokenizer, self._vocab))

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread (MLX's exit abort with two threads: docs/serving.md,
        "engine.py")."""
        try:
            while not self._stop.is_set():
                try:
                    self.step(DEFAULT_IDLE_WAIT_S)
                except Exception:  # noqa: BLE001 - a dead engine thread is a dead server
                    log.exception("engine step failed; the engine goes on")
            self.table.shutdown("server shutting down")
        finally:
            # MLX aborts at exit if a thread ends with its stream unsynchronized
            mx.synchronize()

    def step(self, idle_wait_s: float = 0.0) -> bool:
        """Admit waiting sessions and run one iteration; False when there was nothing to run
        (the engine thread's loop; callers without one step it themselves)."""
        with self._cv:
            self.table.admit(self._start)
        if self._lost is not None:  # the given verifier failed opening a session: its owner's
            lost, self._lost = self._lost, None
            raise lost
        with self._cv:
            if self._ahead is not None:  # a session cancelled since: its step is dropped
                self._ahead = self._ahead.of(self.table.active)
            if not self.table.active:
                if idle_wait_s:
                    self._cv.wait(idle_wait_s)
                return False
            batch = [s for s in self.table.active if s.kv_handle.shipped_kv is None]
            installing = [s for s in self.table.active if s.kv_handle.shipped_kv is not None]
        try:
            if installing:
                share = self.install_share if batch else 0.0  # others decode meanwhile
                self.session_kv.install_some(
                    installing, share * (self.costs.stall.decode_ms or DEFAULT_DECODE_MS),
                    self._fail)
            if batch:
                self._iteration(batch)
        except Exception as e:  # noqa: BLE001 - the engine outlives any one bad iteration
            self._ahead = None
            for s in batch:
                self.table.finish(s, failed=f"engine error: {type(e).__name__}: {e}")
            if self.session_kv.verifier is not None:
                raise  # the given verifier's failure is its owner's (a sharded one lost a rank)
            log.exception("batch iteration failed")
        return True

    def run_until_idle(self, max_iterations: int = 100_000) -> int:
        """Step until no session is left (synchronous use); returns the iterations run."""
        n = 0
        while n < max_iterations and self.step():
            n += 1
        return n

    def _start(self, s: BatchSession) -> None:
        """An admitted session's cache, rng and drafters' verify(L) table; its prompt's KV
        when the prompt cache holds it."""
        try:
            self.session_kv.open(s)
        except Exception as e:
            if self.session_kv.verifier is not None:
                self._lost = e
            raise
        s.rng = make_rng(s.req.params, stream=0)  # SpecInfer's tree rule (drafts with q)
        s.seed = 0 if s.req.params.greedy else generation_seed(s.req.params)
        for d in (s.group, s.prediction):  # its drafters size trees against verify(L)
            if d is not None:
                d.seed_verify_costs(self.costs.verify_costs())
        self.session_kv.reuse(s)

    def _fail(self, s: BatchSession, message: str) -> None:
        with self._cv:
            self.table.finish(s, failed=message)

    def _iteration(self, batch: list[BatchSession]) -> None:
        it, self._ahead = self._ahead, None
        if it is not None:  # dispatched while the last iteration was read: plain steps
            self.drafting.draft_all([s for s, _ in it.run], {s.sid: 0 for s, _ in it.run})
        else:
            it = self._dispatch(batch)
        # the device computes this iteration; the next one goes out behind it when it can
        going = self._steps_ahead(it)
        nxt = None
        if going:
            # this iteration's cache buffers become the next one's inputs: held here too, the
            # next forward's writes could not update them in place (MLX copies a buffer
            # another reference holds); that forward evaluates them
            it = replace(it, fwd=replace(it.fwd, state=()))
            nxt = self._dispatch_ahead(it, going)
        # ONE host synchronisation for the iteration (serve/decode.py)
        read = read_iteration(it.run, it.fwd.logits, it.fwd.pending(), it.decided, it.lps)
        now = self.clock()
        ms = (now - it.t0) * 1e3
        n_dec = sum(sl.tokens for _, sl in it.run if not sl.prefill)
        rec = IterationView(it.t0, len(it.run), n_dec,
                            sum(sl.tokens for _, sl in it.run) - n_dec,
                            len(self.table.waiting), ms)
        self.costs.observe(rec)
        with self._cv:
            self.history.append(rec)
            self.iterations += 1
        # the next iteration's positions are held out of its sessions' caches while this one
        # commits (docs/serving.md, "engine.py")
        if nxt is not None:
            for s, _ in nxt.run:
                s.cache.trim(1)
        self.decode.verified(it.run, it.segs, it.fwd.hidden, ms, read)
        if nxt is not None:
            nxt = nxt.of(self.table.active)
        if nxt is not None:
            for s, _ in nxt.run:
                s.cache.offset += 1
            # its time runs from this read: the forward computed while this one was read
            self._ahead = replace(nxt, t0=now)

    def _dispatch(self, batch: list[BatchSession]) -> InFlight:
        """Plan the iteration (drafts, slots), build its forward and decisions and start it."""
        # prompt prefixes copied between sessions' rows, with their drafters' hidden states
        batch = self.session_kv.share_prefixes(batch, lambda *a: copy_features(*a))
        decoding = [s for s in batch if s.prefill_left <= 0]
        prefilling = [s for s in batch if s.prefill_left > 0]
        # while others decode, prompts' chunks follow the stall control (results/
        # serve_stall.json); the decoders' drafts share that one allowance, after the prompts
        stalled = self.chunked and not self.invariant and prefilling
        budget = iteration_budget(
            self.token_budget, len(decoding), sum(s.prefill_left for s in prefilling),
            self.costs.chunk_budget(len(decoding), len(prefilling), self.token_budget)
            if stalled else None, self.costs.stall.ratio if self.chunked else 0.0)
        lengths, planned = self.drafting.lengths(decoding, budget, iteration=self.iterations)
        self.drafting.draft_all(decoding, lengths)
        run, segs = plan_segments(batch, budget, planned, chunked=self.chunked,
                                  align=DEFAULT_PREFILL_STEP if self.invariant else 0)
        t0 = self.clock()
        fwd = flat_outputs(self.lm.model, segs, hidden=any(s.feeds for s, _ in run))
        return _launch(tuple(run), tuple(segs), fwd, t0)

    def _steps_ahead(self, it: InFlight) -> list[BatchSession]:
        """The sessions whose next step goes out before `it` is read (`steps_ahead`)."""
        if not self.step_ahead:
            return []
        slots = {s.sid: sl for s, sl in it.run}
        with self._cv:
            active, waiting = list(self.table.active), len(self.table.waiting)
        views = []
        for s in active:
            sl = slots.get(s.sid)
            views.append(AheadView(
                s.sid, sl is not None and not sl.prefill and sl.tokens == 1
                and isinstance(s.cache, RowCache) and s.sid in it.decided,
                s.proposer is not None or s.prediction is not None
                or (s.group is not None and not s.group.plain_ahead),
                s.constraint is not None, s.left, s.cancelled))
        going = set(steps_ahead(views, waiting=waiting, room=self.max_active - len(active)))
        return [s for s in active if s.sid in going]

    def _dispatch_ahead(self, it: InFlight, going: list[BatchSession]) -> InFlight:
        """The next iteration of `going`'s plain steps, built on `it`'s lazy tokens and
        started before `it` is read."""
        run = tuple((s, Slot(s.sid, 1, False)) for s in going)
        # each one's next token: its decision's last entry (a chain's (0, next), a plain
        # tree's [next] or (0, next)), read by the device only
        segs = tuple(Segment(it.decided[s.sid][-1:], s.cache, 0) for s in going)
        fwd = flat_outputs(self.lm.model, segs, hidden=any(s.feeds for s in going))
        return _launch(run, segs, fwd, self.clock(), ahead=1)


def _launch(run: tuple[tuple[BatchSession, Slot], ...], segs: tuple[Segment, ...],
            fwd: FlatOutputs, t0: float, ahead: int = 0) -> InFlight:
    """What the host will read of a forward (decisions, logprobs rows), built lazily and
    started on the device now while the host goes on (as mlx-lm's generate_step)."""
    decided = decisions(run, fwd.logits, ahead=ahead)
    lps = logprob_rows(run, fwd.logits)
    mx.async_eval([*fwd.pending(), *decided.values(),
                   *(a for r in lps.values() for a in r.arrays())])
    return InFlight(run, segs, fwd, decided, lps, t0)


def plan_segments(batch: list[BatchSession], budget: IterationBudget, planned: frozenset[int],
                  *, chunked: bool, align: int
                  ) -> tuple[list[tuple[BatchSession, Slot]], list[Segment]]:
    """The scheduler's slots for an iteration and each one's segment: a prefill chunk, or a
    block cut to its slot. planned: the sessions whose drafts the drafting plan sized; the
    others' fixed-length drafts ride on top of the budget uncut."""
    views = [SessionView(s.sid, s.prefill_left, s.kv_handle.prefilled, s.block.want)
             for s in batch]
    tokens = budget.with_fixed_drafts(sum(v.want - 1 for v in views
                                          if v.prefill_left <= 0 and v.sid not in planned))
    by_sid = {s.sid: s for s in batch}
    segs, run = [], []
    for slot in plan_iteration(views, tokens, chunked=chunked, align=align):
        s = by_sid[slot.sid]
        if slot.prefill:
            done = s.kv_handle.prefilled
            segs.append(Segment(tuple(s.req.prompt[done:done + slot.tokens]), s.cache, None))
        else:
            b = s.block
            b.cut(slot.tokens)
            segs.append(Segment(tuple(b.tree.tokens), s.cache, 0, tuple(b.tree.parents))
                        if b.tree is not None else
                        Segment((s.context[-1], *b.draft.tokens), s.cache, 0))
        run.append((s, slot))
    return run, segs
