"""One request inside the batching engine: what was asked, and the state of its session.

`EngineRequest` is what a caller submits; `BatchSession` is the engine thread's record of it
(its drafter, KV cache, committed tokens, this block's draft and its statistics), read and
written by the engine's parts (serve/engine.py and the modules it names); `SessionHandle` is what
the caller keeps (cancel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from macfleet.engine.block import BlockTally
from macfleet.engine.constraint import Constraint, Grammar
from macfleet.engine.controller import DraftTokens
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.engine.tree_loop import ProposerGroup
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
    logprobs: int | None = None  # also emit each committed token's logprob and this many
    # alternatives (LogprobsCommitted, serve/logprobs.py); None: not asked
    grammar: Grammar | None = None  # the answer must match it (engine/constraint.py)
    # the answer's tokens committed before (by a verifier that failed: a re-planned
    # request), the end of `prompt`: the grammar advances over them before decoding
    committed: tuple[int, ...] = ()
    # whose prompt cache this request reads and fills (serve: the API key's partition, when a
    # server has several keys; "" the one shared cache): prefixes cross no partition
    partition: str = ""
    # the answer the client expects (OpenAI's Predicted Outputs), as token ids: drafted from
    # by engine/proposers/prediction.py beside the session's other drafters (serve/drafting.py)
    prediction: tuple[int, ...] = ()


@dataclass(frozen=True)
class SessionFailed:
    """The engine could not finish this request (the message says why)."""

    message: str


EngineEvent = (TokensCommitted | Finished | SessionFailed | BlockDone | LogprobsCommitted
               | PromptReused)


@dataclass
class BatchSession:
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
    tally: BlockTally = field(default_factory=BlockTally)  # its blocks' statistics
    trials: int = 0  # geometric trials of its drafts (accepted + one per rejected block)
    hits: int = 0  # ... and their successes (its drafters' accepted tokens, not a prediction's)
    draft: Draft = EMPTY_DRAFT
    draft_ms: float = 0.0
    k: int = 0  # drafts asked for this block
    kv: Sequence[tuple[np.ndarray, np.ndarray]] | None = None  # shipped prompt KV to install
    installed: int = 0  # layers of `kv` in the cache so far
    layer_ms: float = 0.0  # the longest one layer of it took to install
    proposer_name: str = "none"
    rng: np.random.Generator | None = None
    seed: int = 0  # sampled draws keyed by (seed, output position): sampling.position_keys
    times: TokenTimes = field(default_factory=lambda: TokenTimes(0.0))
    admitted: bool = False
    on_close: Callable[[], None] | None = None
    constraint: Constraint | None = None  # the request's grammar state (structured output)
    # the request's prediction's drafter (engine/proposers/prediction.py), beside the others:
    # its draft, when it has one, is the last of this block's tree (`predicted`)
    prediction: Proposer | None = None
    predicted: bool = False
    prediction_drafted: int = 0  # its tokens verified, all blocks
    prediction_accepted: int = 0  # ... and accepted

    @property
    def prefill_left(self) -> int:
        return len(self.req.prompt) - 1 - self.prefilled

    @property
    def left(self) -> int:
        """Tokens it may still generate past this block's one (its longest draft)."""
        return self.req.max_tokens - len(self.generated) - 1

    def view(self, state: str = "") -> ServedSession:
        """This session for the dashboard; `state` given when it ended."""
        t = self.times
        state = state or ("queued" if not self.admitted else
                          "prefill" if self.prefill_left > 0 else "decode")
        return ServedSession(sid=self.sid, state=state, prompt_tokens=len(self.req.prompt),
                             prefill_left=max(0, self.prefill_left),
                             generated=len(self.generated), ttft_ms=t.ttft_ms,
                             itl_p50_ms=t.itl_ms(0.5), itl_p99_ms=t.itl_ms(0.99),
                             accepted=self.tally.accepted, drafted=self.tally.drafted)


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
