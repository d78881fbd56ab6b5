"""The continuous-batching engine: one thread, one flat forward per iteration.

Each iteration (1) drops sessions whose client left, admits waiting ones, (2) asks every
decoding session's proposer for its draft, (3) lets the pure scheduler pick slots under the
token budget, (4) runs ONE forward over every slot (`engine.batch.flat_forward`) and (5) applies
each session's own acceptance rule, rolls back its own cache and emits its committed tokens.
A session follows `engine.loop.speculative_generate` step for step (prefill prompt[:-1], then
blocks [last token, drafts...], the same per-request rng), so a request's greedy ids and seeded
samples are what the single-session loop gives; only the forward is shared.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from macfleet.engine.acceptance import accept_exact_sample, accept_greedy, accept_ratio
from macfleet.engine.constraint import (Constraint, Grammar, bridge, constrained_draft,
                                         grammar_error, masked_logits)
from macfleet.engine.batch import (BatchKV, RowCache, Segment, check_batchable, flat_forward,
                                   trim_cache)
from macfleet.engine.controller import AUTO, DraftTokens, make_controller
from macfleet.engine.proposers.eagle.chain import EagleProposer, draft_chains, share_head_rows
from macfleet.engine.tree_budget import VerifyCurve
from macfleet.engine.events import BlockDone, Finished, GenerationStats, TokensCommitted
from macfleet.engine.loop import ProposerFailed, sanitize_draft
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.sampling import SamplingParams, make_rng, probs_from_logits
from macfleet.engine.text import make_group, no_drafts, plan_drafting
from macfleet.engine.tree import TokenTree, accept_tree_greedy
from macfleet.engine.tree_loop import ProposerGroup, accept_tree, cap_total, tree_of_drafts
from macfleet.engine.verifier import DEFAULT_PREFILL_STEP, make_trimmable_cache
from macfleet.engine.verify_costs import verify_costs
from macfleet.fleet.batch import BatchView, IterationView, ServedSession
from macfleet.serve.logprobs import (LogprobsCommitted, TokenLogprob, block_logprobs,
                                      chain_rows, tree_rows)
from macfleet.serve.prompt_cache import PromptCache, PromptReused, row_kv
from macfleet.serve.scheduler import (DEFAULT_STALL_RATIO, DEFAULT_TOKEN_BUDGET, DraftView,
                                      STALL_EMA, IterationCost, PrefixView, SessionView,
                                      StallControl, draft_acceptance, draft_room,
                                      plan_drafts, plan_iteration, plan_prefix_sharing)
from macfleet.serve.timing import RECENT_SESSIONS, TokenTimes

log = logging.getLogger(__name__)

DEFAULT_MAX_ACTIVE = 16
DEFAULT_MAX_QUEUE = 64
DEFAULT_IDLE_WAIT_S = 0.05
ITERATION_HISTORY = 256
POOL_BLOCKS = 256  # recent drafted blocks whose acceptance every session's estimate leans on
PROBE_EVERY = 16  # sessions try one draft at least this often, whatever the estimates say
PROBE_GROUPS = 4  # ... in this many groups, spread over those iterations
OWN_STORE_PROMPT = 512  # prompts longer than this keep their KV in a store of their own
# a shipped KV (flow KV) is copied into the batch a few layers per iteration while others
# decode: each iteration spends at most this share of a decode-only iteration on it
DEFAULT_INSTALL_SHARE = 0.25
DEFAULT_DECODE_MS = 100.0  # the decode iteration assumed before one is measured


class Overloaded(RuntimeError):
    """The wait queue is full: the caller should answer 'try again later'."""


@dataclass(frozen=True)
class EngineRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    text: str | None = None  # the prompt as text (chat template applied), for fleet backends
    draft_tokens: DraftTokens | None = None  # this request's draft length (None: the engine's)
    report_blocks: bool = False  # also emit a BlockDone per verified block (agent metrics)
    logprobs: int | None = None  # also emit each committed token's logprob and this many
    # alternatives (LogprobsCommitted, serve/logprobs.py); None: not asked
    grammar: Grammar | None = None  # issue 32: the answer must match it (engine/constraint.py)


@dataclass(frozen=True)
class SessionFailed:
    """The engine could not finish this request (the message says why)."""

    message: str


EngineEvent = (TokensCommitted | Finished | SessionFailed | BlockDone | LogprobsCommitted
               | PromptReused)


@dataclass
class _Session:
    sid: int
    req: EngineRequest
    emit: Callable[[EngineEvent], None]
    proposer: Proposer | None  # a chain drafter
    controller: object
    group: ProposerGroup | None = None  # or drafters whose drafts make a token tree
    tree: TokenTree | None = None  # this block's tree (a group's session)
    drafts: list[Draft] = field(default_factory=list)  # the drafts it was made of
    feeds: list = field(default_factory=list)  # its hidden-state drafters (fed by the engine)
    auto_tree: bool = False  # a group with automatic draft lengths: its tree size is planned
    cache: list | None = None
    context: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0
    shared: int = 0  # prompt tokens copied from another session's cache
    cached: int = 0  # prompt tokens installed from the prompt cache
    cancelled: bool = False
    t_start: float = 0.0
    prefill_ms: float = 0.0
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    trials: int = 0  # geometric trials of its drafts (accepted + one per rejected block)
    hist: list[int] = field(default_factory=list)  # drafted blocks by accepted length
    draft: Draft = EMPTY_DRAFT
    draft_ms: float = 0.0
    k: int = 0  # drafts asked for this block
    draft_total_ms: float = 0.0
    verify_total_ms: float = 0.0
    kv: Sequence[tuple[np.ndarray, np.ndarray]] | None = None  # shipped prompt KV to install
    installed: int = 0  # layers of `kv` in the cache so far
    layer_ms: float = 0.0  # the longest one layer of it took to install
    proposer_name: str = "none"
    rng: np.random.Generator | None = None
    times: TokenTimes = field(default_factory=lambda: TokenTimes(0.0))
    admitted: bool = False
    on_close: Callable[[], None] | None = None
    constraint: Constraint | None = None  # issue 32: the request's grammar state

    @property
    def prefill_left(self) -> int:
        return len(self.req.prompt) - 1 - self.prefilled

    def view(self, state: str = "") -> ServedSession:
        """This session for the dashboard; `state` given when it ended."""
        t = self.times
        state = state or ("queued" if not self.admitted else
                          "prefill" if self.prefill_left > 0 else "decode")
        return ServedSession(sid=self.sid, state=state, prompt_tokens=len(self.req.prompt),
                             prefill_left=max(0, self.prefill_left),
                             generated=len(self.generated), ttft_ms=t.ttft_ms,
                             itl_p50_ms=t.itl_ms(0.5), itl_p99_ms=t.itl_ms(0.99),
                             accepted=self.accepted, drafted=self.drafted)


class SessionHandle:
    """What a caller holds for one request: cancel() frees its session at the next iteration."""

    def __init__(self, session: _Session, wake: Callable[[], None]) -> None:
        self._s, self._wake = session, wake

    @property
    def sid(self) -> int:
        return self._s.sid

    def cancel(self) -> None:
        self._s.cancelled = True
        self._wake()


class BatchEngine:
    """Runs every active session's blocks and prefill chunks in one forward per iteration."""

    supports_logprobs = True  # EngineRequest.logprobs honoured (the HTTP layer asks)
    supports_grammar = True  # EngineRequest.grammar honoured (issue 32)

    def __init__(self, lm: LoadedModel, *, proposer: str = "ngram",
                 draft_tokens: int | str = "auto", token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_active: int = DEFAULT_MAX_ACTIVE, max_queue: int = DEFAULT_MAX_QUEUE,
                 chunked: bool = True, invariant: bool = False,
                 stall_ratio: float = DEFAULT_STALL_RATIO,
                 install_share: float = DEFAULT_INSTALL_SHARE,
                 clock: Callable[[], float] = time.perf_counter,
                 compute_lock: threading.Lock | None = None,
                 prompt_cache_bytes: int = 0) -> None:
        """stall_ratio: prefill chunks are sized so an iteration costs at most this many times
        a decode-only one (0: only the token budget bounds them); compute_lock: held around
        each iteration, when another thread runs the same model (the verifier agent's
        one-session path); install_share: a shipped prompt KV is copied into the batch a few
        layers per iteration, at most this share of a decode-only iteration's time each, while
        other sessions decode (0: all at once); prompt_cache_bytes: keep finished requests' KV
        within this many bytes for later prompts that start the same (0: no prompt cache;
        serve/prompt_cache.py)."""
        check_batchable(lm.model)
        self.lm, self.proposer_spec, self.draft_tokens = lm, proposer, draft_tokens
        self.invariant = invariant
        probe = self._drafting(draft_tokens)  # a spec this engine cannot run fails here
        if probe is not None:
            probe.close()
        self.token_budget, self.max_active, self.max_queue = token_budget, max_active, max_queue
        self.chunked, self.clock = chunked, clock
        self._compute = compute_lock if compute_lock is not None else contextlib.nullcontext()
        self._stall = StallControl(stall_ratio)  # its cost curve: at the first chunk
        self._stall_checked = False
        self.install_share = install_share
        self._cost = IterationCost()  # iterations' ms vs tokens, for draft lengths
        self._batch_curve: VerifyCurve | None = None  # decode iterations' ms by tokens
        self._step_ms: float | None = None  # one draft position of the chains drafted together
        self._pool: deque[tuple[int, int]] = deque(maxlen=POOL_BLOCKS)  # (trials, accepted)
        # every session's KV is a row of one store (flat batch), or its own caches (invariant)
        self._kv = None if invariant else BatchKV(len(lm.model.layers))
        self.prompt_cache = (PromptCache(prompt_cache_bytes)
                             if prompt_cache_bytes > 0 and not invariant else None)
        self._head_rows: dict[int, BatchKV] = {}  # local EAGLE heads' caches, one store each
        self._vocab = lm.vocab_size
        self._layout = None  # the model's KV layout, read when a shipped KV first arrives
        self._costs: dict[int, float] | None = None  # verify(L), read when a group joins
        self._waiting: deque[_Session] = deque()
        self._active: list[_Session] = []
        self._next_sid = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: deque[IterationView] = deque(maxlen=ITERATION_HISTORY)
        self._ended: deque[ServedSession] = deque(maxlen=RECENT_SESSIONS)
        self.iterations = 0

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

    def load(self) -> tuple[int, int]:
        """(active sessions, waiting sessions)."""
        with self._cv:
            return len(self._active), len(self._waiting)

    def sessions(self) -> list[ServedSession]:
        """Active, then waiting, then recently ended sessions (for /health and the dashboard)."""
        with self._cv:
            live = [*self._active, *self._waiting]
            ended = list(self._ended)
        return [s.view() for s in live] + ended[::-1]

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
               kv: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> SessionHandle:
        """Queue a request; `emit` is called from the engine thread with its events, and
        `on_close` once when its session is gone (finished, failed or cancelled).

        proposer: this request's own drafter (the verifier agent's remote proposers): a chain
        drafter, or a group whose drafts make a token tree; started and closed here. None: one
        made from the engine's `proposer` spec.
        kv: the KV of prompt[:-1] computed elsewhere (a prefill agent's, flow KV): per layer
        (keys, values) [kv_heads, len(prompt) - 1, head_dim]; installed, not computed."""
        if not req.prompt or not all(0 <= int(t) < self._vocab for t in req.prompt):
            raise ValueError(f"prompt must be 1+ token ids in 0..{self._vocab - 1}")
        if req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        if kv is not None and (len(kv) != len(self.lm.model.layers)
                               or kv[0][0].shape[1] != len(req.prompt) - 1):
            raise ValueError("the shipped KV must cover every layer and prompt[:-1]")
        draft_tokens = req.draft_tokens if req.draft_tokens is not None else self.draft_tokens
        # issue 32: structured output (GrammarError, a ValueError, for a grammar it refuses)
        constraint = (Constraint(req.grammar, self.lm.tokenizer, self._vocab)
                      if req.grammar is not None else None)
        if proposer is not None:
            self._check_drafting(proposer)
        drafting = proposer if proposer is not None else self._drafting(draft_tokens)
        name = drafting.name if drafting is not None else "none"
        group = drafting if isinstance(drafting, ProposerGroup) else None
        chain = None if group is not None else drafting
        feeds = [p for p in (group.proposers if group is not None else [chain])
                 if p is not None and p.wants_features]
        for p in feeds:  # the flat forward runs no tap: the engine feeds its features
            p.untap()
        if drafting is not None:
            drafting.start(req.params)
        controller = make_controller(draft_tokens if chain is not None else 0)
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                if drafting is not None:
                    drafting.close()
                raise Overloaded(f"{len(self._waiting)} requests are already waiting")
            s = _Session(self._next_sid, req, emit, chain, controller, group=group, feeds=feeds,
                         auto_tree=group is not None and draft_tokens == AUTO,
                         on_close=on_close, times=TokenTimes(self.clock()),
                         proposer_name=name, kv=kv, constraint=constraint)
            self._next_sid += 1
            self._waiting.append(s)
            self._cv.notify()
        return SessionHandle(s, self._wake)

    def grammar_error(self, grammar: Grammar) -> str | None:
        """Issue 32: why this model cannot follow `grammar` (None: it can). Builds the grammar
        engine's tokenizer on first use (1-3 s): callers run it off their event loop."""
        return grammar_error(grammar, bridge(self.lm.tokenizer, self._vocab))

    def _drafting(self, draft_tokens: DraftTokens) -> Proposer | ProposerGroup | None:
        """A new session's drafter from the engine's spec: a chain drafter, a group (several
        drafters joined by '+', or one that drafts trees), or None."""
        lm = self.lm
        drafting = plan_drafting(
            self.proposer_spec, chain=lambda spec: make_proposer(spec, lm),
            tree=lambda specs: make_group([make_proposer(x, lm) or no_drafts(x) for x in specs],
                                          draft_tokens))
        if drafting is not None:
            try:
                self._check_drafting(drafting)
            except ValueError:
                drafting.close()
                raise
        return drafting

    def _check_drafting(self, drafting: Proposer | ProposerGroup) -> None:
        if self.invariant and (isinstance(drafting, ProposerGroup) or drafting.drafts_trees
                               or drafting.wants_features):
            raise ValueError(f"'{drafting.name}' drafts token trees or from hidden states; the "
                             "batch-invariant mode verifies chains from token drafters (each "
                             "session runs the model's own forward)")

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread. Note: MLX (0.32, ml-explore/mlx#3126) may abort the process at
        exit once two threads have run compiled functions (mlx-lm's swiglu): the `serve`
        command ends with os._exit after a clean shutdown, and tests run servers as
        subprocesses or step the engine on their own thread."""
        try:
            self._loop()
        finally:
            # MLX aborts the process at exit if a thread that ran work on its per-thread
            # stream ends with that stream unsynchronized
            mx.synchronize()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(DEFAULT_IDLE_WAIT_S)
            except Exception:  # noqa: BLE001 - a dead engine thread is a dead server
                log.exception("engine step failed; the engine goes on")
        with self._cv:
            for s in [*self._active, *self._waiting]:
                self._finish(s, failed="server shutting down")

    def step(self, idle_wait_s: float = 0.0) -> bool:
        """Admit waiting sessions and run one iteration; False when there was nothing to run.

        The engine thread calls this in a loop; tests call it (or `run_until_idle`) on their
        own thread instead of `start()`."""
        with self._cv:
            self._admit()
            if not self._active:
                if idle_wait_s:
                    self._cv.wait(idle_wait_s)
                return False
            batch = [s for s in self._active if s.kv is None]
            installing = [s for s in self._active if s.kv is not None]
        try:
            with self._compute:
                if installing:
                    self._install_some(installing, others_decode=bool(batch))
                if batch:
                    self._iteration(batch)
        except Exception as e:  # noqa: BLE001 - the engine outlives any one bad iteration
            log.exception("batch iteration failed")
            for s in batch:
                self._finish(s, failed=f"engine error: {type(e).__name__}: {e}")
        return True

    def run_until_idle(self, max_iterations: int = 100_000) -> int:
        """Step until no session is left (synchronous use); returns the iterations run."""
        n = 0
        while n < max_iterations and self.step():
            n += 1
        return n

    def _admit(self) -> None:
        """Under the lock: drop cancelled sessions, move waiting ones in while there is room."""
        self._active = [s for s in self._active if not self._drop_if_cancelled(s)]
        self._waiting = deque(s for s in self._waiting if not self._drop_if_cancelled(s))
        while self._waiting and len(self._active) < self.max_active:
            s = self._waiting.popleft()
            s.t_start = self.clock()
            s.admitted = True
            s.context = list(s.req.prompt)
            if s.req.max_tokens == 0:
                self._finish(s, reason="length")
                continue
            try:
                if self._kv is None:
                    s.cache = make_trimmable_cache(self.lm.model)
                else:
                    # a long prompt gets a store of its own: growing the shared one to its
                    # length would copy every row's keys (a ~1 s stall for a 2,000-token
                    # prompt beside 8 decoders); room for the whole prompt now, one growth
                    store = (self._kv if len(s.req.prompt) <= OWN_STORE_PROMPT
                             else BatchKV(len(self.lm.model.layers), row_step=1))
                    s.cache = store.open()
                    store.reserve(s.cache.row + 1, len(s.req.prompt))
                    share_head_rows(s.proposer, self._head_rows)  # its head's cache: a row
                s.rng = make_rng(s.req.params, stream=0)
                if s.group is not None:  # its drafters size trees against verify(L)
                    s.group.seed_verify_costs(self._verify_costs())
                if self.prompt_cache is not None and s.kv is None and not s.feeds:
                    s.cached, s.kv = self.prompt_cache.lookup(s.req.prompt)  # installed as
                    # a shipped KV is, over iterations
                if s.kv is not None and not isinstance(s.cache, RowCache):
                    self._install(s)  # batch-invariant mode: per-session caches, at once
            except Exception as e:  # noqa: BLE001 - one bad session fails alone
                log.exception("session %d could not start", s.sid)
                self._finish(s, failed=f"could not start: {type(e).__name__}: {e}")
                continue
            self._active.append(s)

    def _stall_curve(self) -> VerifyCurve | None:
        """The stall control's cost curve: this machine's verify(L) table when one is already
        known (a drafter's group probed it, or an earlier run left it on disk), never probed
        here (a ~2 s probe would stall the sessions the chunks are sized for). None when no
        table is known: the stall control follows its measurements alone."""
        from macfleet.engine.verify_costs import known_verify_costs

        costs = self._costs if self._costs is not None else known_verify_costs(self.lm.model)
        if not costs:
            return None
        curve = VerifyCurve()
        curve.seed(costs)
        return curve

    def _verify_costs(self) -> dict[int, float]:
        """The model's measured verify(L) table (as `tree_generate` seeds its group with;
        probed once per machine, on this thread, then cached on disk)."""
        if self._costs is None:
            self._costs = verify_costs(self.lm.model)
            if self._stall.curve is None:  # now known: the stall control sizes chunks by it
                self._stall.curve, self._stall_checked = self._stall_curve(), True
        return self._costs

    def _layout_dtype(self) -> mx.Dtype:
        from macfleet.engine.kvship import model_layout

        if self._layout is None:
            self._layout = model_layout(self.lm.model)
        return getattr(mx, self._layout.dtype)

    def _install(self, s: _Session) -> None:
        """A shipped prompt KV into the session's fresh per-layer caches, all at once."""
        from macfleet.engine.kvship import install

        self._layout_dtype()
        install(s.cache, self._layout, s.kv)
        self._installed(s)

    def _installed(self, s: _Session) -> None:
        s.prefilled = s.kv[0][0].shape[1]  # prompt[:-1] shipped; a prompt cache's prefix
        s.kv = None
        if s.prefill_left <= 0:
            s.prefill_ms = (self.clock() - s.t_start) * 1e3

    def _install_some(self, installing: list[_Session], others_decode: bool) -> None:
        """Copy shipped prompt KVs into their batch rows, layer by layer, oldest first. While
        other sessions decode, one iteration spends at most `install_share` of a decode-only
        iteration on it (at least one layer, so an install always moves): a long prompt's KV
        (an 8,000-token one is ~1 s of copying here) never stalls the batch in one piece. A
        session joins the forward once its last layer is in."""
        share = self.install_share if others_decode else 0.0
        budget_ms = share * (self._stall.decode_ms or DEFAULT_DECODE_MS)
        t0 = self.clock()
        dtype = self._layout_dtype()
        moved = False
        for s in installing:
            n_layers = len(s.kv)
            while s.installed < n_layers:
                spent = (self.clock() - t0) * 1e3
                if share > 0 and moved and spent + s.layer_ms > budget_ms:
                    return
                moved = True
                t1 = self.clock()
                try:
                    s.cache.store.install(s.cache, s.kv, dtype, range(s.installed,
                                                                       s.installed + 1))
                except Exception as e:  # noqa: BLE001 - one bad KV fails its session alone
                    log.exception("session %d: shipped KV could not be installed", s.sid)
                    with self._cv:
                        self._finish(s, failed=f"could not install the shipped KV: "
                                               f"{type(e).__name__}: {e}")
                    break
                s.layer_ms = max(s.layer_ms, (self.clock() - t1) * 1e3)
                s.installed += 1
                if s.installed == n_layers:
                    self._installed(s)

    def _drop_if_cancelled(self, s: _Session) -> bool:
        if s.cancelled:
            log.debug("session %d cancelled by its client", s.sid)
            self._release(s, "cancelled")
        return s.cancelled

    def _release(self, s: _Session, state: str) -> None:
        with self._cv:  # an RLock: some callers hold it already
            self._ended.append(s.view(state))
        if isinstance(s.cache, RowCache):
            if state == "done" and self.prompt_cache is not None:
                self._retain(s)
            s.cache.close()
        s.cache = None
        if s.on_close is not None:
            s.on_close()
            s.on_close = None
        if s.proposer is not None:
            s.proposer.close()
            s.proposer = None
        if s.group is not None:
            s.group.close()
            s.group = None

    def _retain(self, s: _Session) -> None:
        """A finished session's KV (prompt and answer) into the prompt cache: the positions
        whose tokens are its context (not a cut-off stop token's)."""
        n = min(s.cache.offset, len(s.context) - 1)
        if n < self.prompt_cache.min_tokens or s.cache.store.keys[0] is None:
            return
        try:
            self.prompt_cache.insert(s.context[:n], row_kv(s.cache.store, s.cache.row, n))
        except (RuntimeError, ValueError, MemoryError) as e:  # not kept: later prompts prefill
            log.warning("session %d: KV not kept in the prompt cache: %s", s.sid, e)

    def _draft_lengths(self, decoding: list[_Session], room: int | None = None
                       ) -> tuple[dict[int, int], frozenset[int]]:
        """Each decoding session's draft length: what its controller asks for, cut by
        `plan_drafts` to the drafts that pay at this batch's measured costs, then to `room`
        (draft tokens the iteration has room for; None: no limit); and the sessions so
        planned. The others keep their fixed length: their drafts, and so a seeded sample,
        do not depend on the batch."""
        wants = {s.sid: min(s.group.node_budget if s.group is not None else s.controller.next_k(),
                            s.req.max_tokens - len(s.generated) - 1)
                 for s in decoding}
        # in a batch, a tree session counts as a chain along its accepted path and the planned
        # drafts cap its tree's nodes; alone, its drafters size the tree against verify(L) as
        # in one process (a tree's value is not a chain's: measured, the plan cut trees that
        # paid 1.24x for a single client)
        adaptive = [s for s in decoding if wants[s.sid] > 0 and (
            (s.auto_tree and len(decoding) > 1)
            or (s.proposer is not None and getattr(s.controller, "alpha", None) is not None))]
        cost = self._batch_cost()
        planned_sids = frozenset(s.sid for s in adaptive)
        if not adaptive:
            return wants, planned_sids
        if cost is None:
            return self._within(wants, adaptive, room), planned_sids
        pool_n, pool_acc = (sum(x) for x in zip((0, 0), *self._pool))
        # sessions probe in PROBE_GROUPS groups, each group together once in PROBE_EVERY
        # iterations: one session's probe in every iteration (they used to take turns) made
        # every iteration pay an extra row (on a CPU often a kernel block) and, for a remote
        # drafter, a round trip; all of them at once made one iteration in PROBE_EVERY a spike
        # (a remote head catching up on every session: inter-token p99 0.5 s at 16 clients)
        phase = self.iterations % PROBE_EVERY
        step = PROBE_EVERY // PROBE_GROUPS
        views = [DraftView(s.sid, draft_acceptance(s.accepted, s.trials, pool_acc, pool_n),
                           wants[s.sid], getattr(s.controller, "draft_ms", None) or 0.0,
                           probe=phase == (s.sid % PROBE_GROUPS) * step,
                           together=_rows_of(s.proposer) is not None)
                 for s in adaptive]
        fixed = sum(1 + wants[s.sid] for s in decoding if s not in adaptive)
        planned = plan_drafts(views, lambda n: cost(n + fixed), self._step_ms or 0.0,
                              stall_ratio=self._stall.ratio if self.chunked else 0.0)
        return self._within({**wants, **planned}, adaptive, room), planned_sids

    @staticmethod
    def _within(ks: dict[int, int], adaptive: list[_Session], room: int | None
                ) -> dict[int, int]:
        """The adaptive sessions' lengths cut (largest first) to the room the fixed ones
        leave."""
        if room is None:
            return ks
        mine = [s.sid for s in adaptive]
        planned = set(mine)
        left = room - sum(k for sid, k in ks.items() if sid not in planned)
        return {**ks, **dict(zip(mine, cap_total([ks[sid] for sid in mine], left)))}

    def _curve(self) -> VerifyCurve:
        if self._batch_curve is None:
            self._batch_curve = self._stall_curve() or VerifyCurve()
        return self._batch_curve

    def _batch_cost(self) -> Callable[[int], float] | None:
        """What a forward over n tokens costs this batch: the curve of its own decode
        iterations (seeded with this machine's verify(L) table when one is known), or the
        line through the recent iterations; None before anything is measured."""
        if self._curve().samples:
            return self._batch_curve.cost
        if self._cost.predict(1) is None:
            return None
        return lambda n: self._cost.predict(n)

    def _draft_all(self, decoding: list[_Session], ks: dict[int, int]) -> None:
        """Every decoding session's draft: all requests go out first (`begin`), then the
        replies are collected (`finish`), so drafters on other machines draft at once and the
        batch waits for the slowest, not for the sum."""
        t0 = self.clock()
        asked, groups, together = [], {}, {}
        for s in decoding:
            s.draft, s.k, s.tree, s.drafts = EMPTY_DRAFT, ks[s.sid], None, []
            rows = _rows_of(s.proposer) if s.k > 0 else None
            if rows is not None:
                together.setdefault(id(rows), []).append(s)
            elif s.group is not None:
                groups[s.sid] = cap_total(
                    s.group.lengths(s.req.max_tokens - len(s.generated) - 1), ks[s.sid])
                s.k = sum(groups[s.sid])
                s.group.begin(s.context, groups[s.sid])
            elif s.proposer is not None and s.k > 0:
                try:
                    s.proposer.begin(s.context, s.k)
                    asked.append(s)
                except ProposerFailed as e:
                    self._lose_proposer(s, e)
        for sessions in together.values():  # local EAGLE chains: all at once
            t1 = self.clock()
            drafts = draft_chains([(s.proposer, s.context, s.k) for s in sessions])
            step = (self.clock() - t1) * 1e3 / max(s.k for s in sessions)
            self._step_ms = step if self._step_ms is None else (
                (1 - STALL_EMA) * self._step_ms + STALL_EMA * step)
            for s, d in zip(sessions, drafts):
                s.draft = sanitize_draft(d, s.k, self._vocab)
                s.draft_ms = d.draft_ms
        drafted = {s.sid for ss in together.values() for s in ss}
        for s in decoding:
            if s.sid in drafted:
                continue
            if s.group is not None:
                s.drafts, s.tree = tree_of_drafts(s.context[-1], s.group.finish(),
                                                  groups[s.sid], self._vocab,
                                                  s.req.params.greedy)
            elif s in asked:
                try:
                    d = sanitize_draft(s.proposer.finish(), s.k, self._vocab)
                    s.draft = d if d.parents is None else EMPTY_DRAFT
                except ProposerFailed as e:
                    self._lose_proposer(s, e)
            s.draft_ms = (self.clock() - t0) * 1e3
            if s.constraint is not None:  # issue 32: forced tokens first, cut to the grammar
                s.tree, s.draft = None, Draft(constrained_draft(
                    s.constraint, s.draft.tokens, s.req.max_tokens - len(s.generated) - 1),
                    None, s.draft_ms)

    def _lose_proposer(self, s: _Session, e: ProposerFailed) -> None:
        log.warning("session %d: proposer failed (%s), continuing without", s.sid, e)
        s.proposer.close()
        s.proposer = None

    def _share_prefixes(self, batch: list[_Session]) -> list[_Session]:
        """New sessions copy the prompt prefix another session's cache holds; those about to
        get one from a session ahead of them sit this iteration out (returned: the others)."""
        if self._kv is None or not any(s.prefilled == 0 < s.prefill_left for s in batch):
            return batch
        # copies stay within a store; sessions fed hidden states copy among themselves, with
        # the source drafters' rows of the prefix (else their drafters would have none)
        mine = [s for s in batch if s.cache.store is self._kv]
        copies, waiting = (), frozenset()
        for group in ([s for s in mine if not s.feeds],
                      [s for s in mine if s.feeds and all(hasattr(p, "feature_rows")
                                                          for p in s.feeds)]):
            c, w = plan_prefix_sharing([PrefixView(s.sid, tuple(s.context[:s.cache.offset]),
                                                   s.req.prompt[:-1]) for s in group])
            copies, waiting = (*copies, *c), waiting | w
        by_sid = {s.sid: s for s in batch}
        copies = [c for c in copies if self._copy_features(by_sid[c.src], by_sid[c.dst],
                                                           c.tokens)]
        if copies:
            self._kv.copy_prefixes([(by_sid[c.src].cache, by_sid[c.dst].cache, c.tokens)
                                    for c in copies])
        for c in copies:
            dst = by_sid[c.dst]
            dst.prefilled = dst.shared = c.tokens
            if dst.prefill_left <= 0:
                dst.prefill_ms = (self.clock() - dst.t_start) * 1e3
            log.debug("session %d: %d prompt tokens from session %d's cache", c.dst, c.tokens,
                      c.src)
        return [s for s in batch if s.sid not in waiting]

    @staticmethod
    def _copy_features(src: _Session, dst: _Session, n: int) -> bool:
        """A copied prefix's hidden-state rows, from the source's drafters to the
        destination's (pairwise: one engine spec makes the same drafters); False when the
        source's do not hold them all (the destination then prefills itself)."""
        if not dst.feeds:
            return True
        rows = [p.feature_rows(n) for p in src.feeds]
        if len(rows) != len(dst.feeds) or any(r is None for r in rows):
            return False
        for p, h in zip(dst.feeds, rows):
            p.feed_features(0, dst.req.prompt[:n], h)
        return True

    def _iteration(self, batch: list[_Session]) -> None:
        batch = self._share_prefixes(batch)
        decoding = [s for s in batch if s.prefill_left <= 0]
        prefilling = [s for s in batch if s.prefill_left > 0]
        budget, room = self.token_budget, None
        # while others decode, every prompt's chunks follow the stall control: a long one
        # would stall them for many iterations, and a chat turn joining in one piece is the
        # largest gap decoding sessions see otherwise (~2x a decode iteration here); the
        # decoders' drafts share that one allowance, after the prompts
        if self.chunked and not self.invariant and prefilling:
            if not self._stall_checked:
                self._stall.curve, self._stall_checked = self._stall_curve(), True
            budget = self._stall.budget(len(decoding), budget, waiting=len(prefilling),
                                        decoding=len(decoding))
            room = draft_room(budget, len(decoding), sum(s.prefill_left for s in prefilling))
        lengths, planned = self._draft_lengths(decoding, room)
        self._draft_all(decoding, lengths)
        views = [SessionView(s.sid, s.prefill_left, s.prefilled,
                             len(s.tree.tokens) if s.tree is not None else 1 + len(s.draft))
                 for s in batch]
        if room is not None:  # fixed-length drafts ride on top of the allowance, uncut
            budget = min(self.token_budget, budget + sum(
                v.want - 1 for v in views if v.prefill_left <= 0 and v.sid not in planned))
        align = DEFAULT_PREFILL_STEP if self.invariant else 0
        slots = plan_iteration(views, budget, chunked=self.chunked, align=align)
        by_sid = {s.sid: s for s in batch}
        segs, run = [], []
        for slot in slots:
            s = by_sid[slot.sid]
            if slot.prefill:
                toks = tuple(s.req.prompt[s.prefilled:s.prefilled + slot.tokens])
                segs.append(Segment(toks, s.cache, None))
            elif s.tree is not None:  # cut to the slot: its first nodes are a tree too
                s.tree = s.tree.first(slot.tokens)
                segs.append(Segment(tuple(s.tree.tokens), s.cache, 0, tuple(s.tree.parents)))
            else:
                s.draft = Draft(s.draft.tokens[:slot.tokens - 1], None if s.draft.probs is None
                                else s.draft.probs[:slot.tokens - 1], s.draft.draft_ms)
                segs.append(Segment((s.context[-1], *s.draft.tokens), s.cache, 0))
            run.append((s, slot))
        t0 = self.clock()
        hidden = None
        if any(s.feeds for s, _ in run):
            out, hidden = flat_forward(self.lm.model, segs, hidden=True)
        else:
            out = flat_forward(self.lm.model, segs)
        ms = (self.clock() - t0) * 1e3
        n_dec = sum(sl.tokens for _, sl in run if not sl.prefill)
        rec = IterationView(t0, len(run), n_dec, sum(sl.tokens for _, sl in run) - n_dec,
                            len(self._waiting), ms)
        self._stall.observe(rec.prefill_tokens, rec.decode_tokens, ms)
        self._cost.observe(rec.decode_tokens + rec.prefill_tokens, ms)
        if rec.prefill_tokens == 0:
            self._curve().observe(rec.decode_tokens, ms)
        with self._cv:
            self.history.append(rec)
            self.iterations += 1
        # every greedy block's argmax rows in one evaluation (one host synchronisation for
        # the batch, not one per session: on a GPU each costs a launch and a round trip)
        ids = {s.sid: mx.argmax(masked_logits(s.constraint, lg, s.draft.tokens), axis=-1)
               for (s, sl), lg in zip(run, out)
               if not sl.prefill and s.req.params.greedy}
        mx.eval(list(ids.values()))
        ids = {sid: a.tolist() for sid, a in ids.items()}
        accepted = self._accept_trees([(s, lg) for (s, sl), lg in zip(run, out)
                                       if not sl.prefill and s.tree is not None], ids)
        if hidden is not None:
            self._feed(run, segs, hidden, accepted)
        for (s, slot), logits in zip(run, out):
            if slot.prefill:
                s.prefilled += slot.tokens
                if s.prefill_left <= 0:
                    s.prefill_ms = (self.clock() - s.t_start) * 1e3
            elif s.tree is not None:
                self._commit_tree(s, *accepted[s.sid], ms, logits)
            else:
                self._commit(s, logits, ms, ids.get(s.sid))

    @staticmethod
    def _feed(run, segs: list[Segment], hidden: list[mx.array],
              accepted: dict[int, tuple[list[int], int]]) -> None:
        """Hidden-state drafters get the rows of their session's forward, as a tap on a
        single-session forward would give them: a prefill chunk's and a chain block's rows at
        their positions (rejected ones are overwritten later), a tree's root and accepted path
        moved behind the root as its cache was."""
        for (s, slot), seg, h in zip(run, segs, hidden):
            if not s.feeds:
                continue
            start = seg.cache.offset - len(seg)  # the offset before this forward
            toks = seg.tokens
            if not slot.prefill and s.tree is not None:
                path = accepted[s.sid][0]
                start = s.cache.offset - 1 - len(path)  # kept: root + path
                toks = (s.tree.tokens[0], *s.tree.path_tokens(path))
                h = h[mx.array([0, *path], dtype=mx.int32)]
            for p in s.feeds:
                p.feed_features(start, toks, h)

    def _accept_trees(self, done: list[tuple[_Session, mx.array]],
                      ids: dict[int, list[int]]) -> dict[int, tuple[list[int], int]]:
        """Each verified tree's accepted path and next token (the rules of `tree_generate`);
        every row then keeps its root and path (one gather and scatter per layer per store)
        before anything is committed, so a session that ends here leaves a consistent row."""
        out, kept = {}, {}
        for s, logits in done:
            path, nxt = out[s.sid] = (accept_tree_greedy(s.tree, ids[s.sid]) if s.sid in ids
                                      else accept_tree(s.tree, logits, s.req.params, s.rng))
            base = s.cache.offset - len(s.tree.tokens)
            kept.setdefault(s.cache.store, []).append((s.cache, base, path))
        for store, rows in kept.items():
            store.keep_paths(rows)
        return out

    def _commit_tree(self, s: _Session, path: list[int], nxt: int, verify_ms: float,
                     logits: mx.array) -> None:
        tree = s.tree
        new = [*tree.path_tokens(path), nxt]
        lps = _logprobs(s, logits, tree_rows(path, len(new)), new)
        if tree.size:
            s.drafted += tree.size
            s.accepted += len(path)
            _count(s.hist, len(path))
            # geometric trials along the path: it stopped where the tree had more to offer
            last = path[-1] if path else 0
            trials = len(path) + bool(tree.children[last])
            s.trials += trials
            self._pool.append((trials, len(path)))
        s.group.observe(s.drafts, tree.accepted_per_source(path), verify_ms, len(tree.tokens))
        self._emit_block(s, new, k=s.k, drafted=tree.size, accepted=len(path),
                         verify_ms=verify_ms, logprobs=lps)

    def _commit(self, s: _Session, logits: mx.array, verify_ms: float,
                target: list[int] | None = None) -> None:
        """target: the block's argmax ids (greedy), computed with the batch's."""
        d = s.draft
        p = s.req.params
        if p.greedy:
            n, nxt = accept_greedy(d.tokens, target if target is not None else np.array(
                mx.argmax(masked_logits(s.constraint, logits, d.tokens), axis=-1)).tolist())
        else:  # issue 32: the grammar's mask first
            probs = probs_from_logits(masked_logits(s.constraint, logits, d.tokens), p)
            n, nxt = (accept_ratio(d.tokens, d.probs, probs, s.rng) if d.probs is not None
                      else accept_exact_sample(d.tokens, probs, s.rng))
        new = [*d.tokens[:n], nxt]
        lps = _logprobs(s, logits, chain_rows(len(new)), new)
        if len(d) - n:
            trim_cache(s.cache, len(d) - n)
        if len(d):
            s.drafted += len(d)
            s.accepted += n
            _count(s.hist, n)
            trials = n + (n < len(d))
            s.trials += trials
            self._pool.append((trials, n))
            if s.proposer is not None:
                s.proposer.observe(len(d), n, verify_ms)
        s.controller.observe(len(d), n, s.draft_ms, verify_ms)
        self._emit_block(s, new, k=s.k, drafted=len(d), accepted=n, verify_ms=verify_ms,
                         logprobs=lps)

    def _emit_block(self, s: _Session, new: list[int], *, k: int, drafted: int, accepted: int,
                    verify_ms: float, logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """A verified block's committed tokens (cut at a stop token) out to the client."""
        stop_at = next((i for i, t in enumerate(new) if t in s.req.eos_ids), None)
        if s.constraint is not None:  # issue 32: the grammar's end is a stop too
            end = s.constraint.commit(new[:stop_at])
            stop_at = end if end is not None else stop_at
        if stop_at is not None:
            new = new[:stop_at]
        s.context.extend(new)
        s.generated.extend(new)
        s.blocks += 1
        if s.blocks == 1 and (s.cached or s.shared):
            s.emit(PromptReused(s.cached + s.shared))
        s.draft_total_ms += s.draft_ms
        s.verify_total_ms += verify_ms
        if s.req.report_blocks:
            s.emit(BlockDone(block=s.blocks, k=k, drafted=drafted, accepted=accepted,
                             committed=len(new), draft_ms=s.draft_ms, verify_ms=verify_ms,
                             block_ms=s.draft_ms + verify_ms))
        if new:
            s.times.commit(self.clock())
            if logprobs:
                s.emit(LogprobsCommitted(logprobs[:len(new)]))
            s.emit(TokensCommitted(s.blocks, tuple(new)))
        if stop_at is not None:
            self._finish(s, reason="stop")
        elif len(s.generated) >= s.req.max_tokens:
            self._finish(s, reason="length")

    def _finish(self, s: _Session, *, reason: str = "", failed: str = "") -> None:
        if s in self._active:
            self._active.remove(s)
        per_proposer = s.group.per_proposer() if s.group is not None else ()
        self._release(s, "cancelled" if s.cancelled else "failed" if failed else "done")
        if s.cancelled:
            return
        if failed:
            s.emit(SessionFailed(failed))
            return
        stats = GenerationStats(
            tokens=len(s.generated), elapsed_s=self.clock() - s.t_start, prefill_ms=s.prefill_ms,
            blocks=s.blocks, drafted=s.drafted, accepted=s.accepted,
            draft_ms=s.draft_total_ms, verify_ms=s.verify_total_ms,
            proposer=s.proposer_name, finish_reason=reason, per_proposer=per_proposer,
            accepted_hist=tuple(s.hist))
        s.emit(Finished(stats, tuple(s.generated)))


def _logprobs(s: _Session, logits: mx.array, rows: list[int], new: list[int]
              ) -> tuple[TokenLogprob, ...] | None:
    """The committed tokens' logprobs when the request asked for them (else None)."""
    if s.req.logprobs is None:
        return None
    return block_logprobs(logits, rows, new, s.req.logprobs)


def _rows_of(p: Proposer | None) -> BatchKV | None:
    """The store a local EAGLE chain drafter's head cache is a row of (drafted together)."""
    return p.rows if isinstance(p, EagleProposer) else None


def _count(hist: list[int], accepted: int) -> None:
    """hist[accepted] += 1, growing the histogram as needed (GenerationStats.accepted_hist)."""
    if accepted >= len(hist):
        hist.extend([0] * (accepted + 1 - len(hist)))
    hist[accepted] += 1
