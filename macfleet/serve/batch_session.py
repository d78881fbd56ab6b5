"""One request inside the batching engine: what was asked, and the state of its session.

`EngineRequest` is what a caller submits (immutable); `BatchSession` is the engine thread's
record of it, made of parts each written by one of the engine's modules (its KV handle, this
block's drafts, its statistics); `SessionHandle` is what the caller keeps (cancel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from macfleet.engine.batch_kv import RowCache, ShippedKV
from macfleet.engine.block import BlockTally
from macfleet.engine.constraint import Constraint, Grammar
from macfleet.engine.controller import DraftTokens
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.fleet.batch import ServedSession
from macfleet.serve.logprobs import LogprobsCommitted
from macfleet.serve.prompt_cache import PromptReused
from macfleet.serve.timing import TokenTimes


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
    logprobs: int | None = None  # alternatives per token of LogprobsCommitted (None: none)
    grammar: Grammar | None = None  # the answer must match it (engine/constraint.py)
    # the end of `prompt` a failed verifier committed already (a re-planned request): the
    # grammar advances over them before decoding
    committed: tuple[int, ...] = ()
    partition: str = ""  # the prompt cache partition it reads and fills (its API key's)
    prediction: tuple[int, ...] = ()  # the answer the client expects (Predicted Outputs)


@dataclass(frozen=True)
class SessionFailed:
    """The engine could not finish this request (the message says why)."""

    message: str


EngineEvent = (TokensCommitted | Finished | SessionFailed | BlockDone | LogprobsCommitted
               | PromptReused)


@dataclass(eq=False)
class KVHandle:
    """A session's KV cache, how much of its prompt is in it and from where, and a
    `shipped_kv` still to install. Written by serve/session_kv.py (`advance` also by
    serve/decode.py's prefill chunks)."""

    positions: int  # prompt positions to hold before decoding: prompt[:-1]
    shipped_kv: ShippedKV | None = None  # shipped (flow KV) or cached prompt KV to install
    cache: list | RowCache | None = None
    prefilled: int = 0  # prompt positions in the cache
    shared: int = 0  # ... copied from another session's cache
    cached: int = 0  # ... installed from the prompt cache
    installed: int = 0  # layers of `shipped_kv` in the cache so far
    layer_ms: float = 0.0  # the longest one layer of it took to install
    ready_at: float | None = None  # when the last prompt position came in (engine clock)

    @property
    def prefill_left(self) -> int:
        return self.positions - self.prefilled

    def advance(self, n: int, now: float) -> None:
        """n more prompt positions in the cache (prefilled, copied or installed) at `now`."""
        self.prefilled += n
        if self.prefill_left <= 0:
            self.ready_at = now


@dataclass(eq=False)
class BlockDraft:
    """One session's block past its root: a chain's `draft`, or a token `tree` made of
    `drafts`; new every block, written by serve/drafting.py (`cut` by the scheduler's slot)."""

    k: int = 0  # drafts asked for
    draft: Draft = EMPTY_DRAFT
    tree: TokenTree | None = None
    drafts: list[Draft] = field(default_factory=list)
    draft_ms: float = 0.0
    predicted: bool = False  # the request's prediction drafted: its draft is the tree's last

    @property
    def want(self) -> int:
        """The tokens it would have verified: root and drafts."""
        return len(self.tree.tokens) if self.tree is not None else 1 + len(self.draft)

    def cut(self, tokens: int) -> None:
        """Cut to the scheduler's slot of `tokens` (a tree's first nodes are a tree too)."""
        if self.tree is not None:
            self.tree = self.tree.first(tokens)
        else:
            d = self.draft
            self.draft = Draft(d.tokens[:tokens - 1],
                               None if d.probs is None else d.probs[:tokens - 1], d.draft_ms)


@dataclass(eq=False)
class SessionStats:
    """A session's statistics, written by serve/decode.py as its blocks commit."""

    times: TokenTimes  # from its submission
    tally: BlockTally = field(default_factory=BlockTally)
    trials: int = 0  # accepted + one per block its drafters' drafts were cut short
    hits: int = 0  # ... their accepted tokens (not a prediction's)
    prediction_drafted: int = 0  # its prediction's tokens verified, all blocks
    prediction_accepted: int = 0  # ... and accepted


@dataclass(eq=False)
class BatchSession:
    """One request's session on the engine thread: the request, its drafters, and parts each
    written by one module (`KVHandle`, `BlockDraft`, `SessionStats`; committed tokens by
    serve/decode.py, its life by serve/lifecycle.py, `cancelled` by its `SessionHandle`)."""

    sid: int
    req: EngineRequest
    emit: Callable[[EngineEvent], None]
    proposer: Proposer | None  # a chain drafter
    controller: object
    kv_handle: KVHandle
    block: BlockDraft
    stats: SessionStats
    group: ProposerGroup | None = None  # or drafters whose drafts make a token tree
    feeds: list = field(default_factory=list)  # its hidden-state drafters (fed by the engine)
    auto_tree: bool = False  # a group with automatic draft lengths: its tree size is planned
    prediction: Proposer | None = None  # the request's prediction's drafter, beside the others
    proposer_name: str = "none"
    constraint: Constraint | None = None  # the request's grammar state (structured output)
    context: list[int] = field(default_factory=list)  # the prompt, then every committed token
    generated: list[int] = field(default_factory=list)
    rng: np.random.Generator | None = None
    seed: int = 0  # sampled draws keyed by (seed, output position): sampling.position_keys
    t_start: float | None = None  # when it was admitted (None: still queued)
    cancelled: bool = False
    on_close: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.context = self.context or list(self.req.prompt)

    @property
    def cache(self) -> list | RowCache | None:
        """Its KV cache (`KVHandle.cache`)."""
        return self.kv_handle.cache

    @property
    def prefill_left(self) -> int:
        return self.kv_handle.prefill_left

    @property
    def prefill_ms(self) -> float:
        """From its admission to its prompt all in its cache (0: a prompt of one token)."""
        ready = self.kv_handle.ready_at
        return 0.0 if ready is None else (ready - self.t_start) * 1e3

    @property
    def left(self) -> int:
        """Tokens it may still generate past this block's one (its longest draft)."""
        return self.req.max_tokens - len(self.generated) - 1

    def view(self, state: str = "") -> ServedSession:
        """This session for the dashboard; `state` given when it ended."""
        t, tally = self.stats.times, self.stats.tally
        state = state or ("queued" if self.t_start is None else
                          "prefill" if self.prefill_left > 0 else "decode")
        return ServedSession(sid=self.sid, state=state, prompt_tokens=len(self.req.prompt),
                             prefill_left=max(0, self.prefill_left),
                             generated=len(self.generated), ttft_ms=t.ttft_ms,
                             itl_p50_ms=t.itl_ms(0.5), itl_p99_ms=t.itl_ms(0.99),
                             accepted=tally.accepted, drafted=tally.drafted)


class SessionHandle:
    """What a caller holds for one request: cancel() frees its session at the next iteration."""

    def __init__(self, session: BatchSession, wake: Callable[[], None]) -> None:
        self._s, self._wake = session, wake

    @property
    def sid(self) -> int:
        return self._s.sid

    def cancel(self) -> None:
        self._s.cancelled = True
        self._wake()
