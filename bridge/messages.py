"""Every message that crosses between Macs: one frozen dataclass per type, in one registry.

Adding a message is one decorated class::

    @message("my_tag")                    # terminal=False for a streamed, non-final reply
    class MyThing:
        \"\"\"Why it exists.\"\"\"
        session_id: str
        values: np.ndarray | None

The decorator (bridge/registry.py, re-exported here with the registry's functions) makes the class
a frozen dataclass (if it is not one already), registers it under its tag and compiles its
annotations into a `Spec` tree at import time, so an unsupported field type fails when the module
loads, not when a peer sends it. The codec walks those Spec trees to validate every field of
every incoming message, which is what makes decoding untrusted bytes safe.

Supported field types: int, float, str, bool, bytes, `X | None`, unions of scalars
(`float | int | str`), `list[X]`, `tuple[X, ...]`, `tuple[X, Y]`, `dict[str, X]`, `np.ndarray`
(a raw buffer frame, never inside msgpack) and nested frozen dataclasses (sent as maps, e.g.
`AgentCard`, or `GenerationStats` from macfleet/stats.py, the one project module bridge imports:
plain records, so the wire carries the very objects the engine produces). A message whose field
is an ndarray compares with `equal()`, not `==`.
"""

from __future__ import annotations

import numpy as np

from bridge.card import PROTOCOL_VERSION, AgentCard
from bridge.registry import (Message, Spec, equal, example, is_terminal, message, message_class,
                             registry, schema, tag_of)
from macfleet.stats import (  # plain records: the one project import here
    GenerationStats, IterationView, ServedSession)

__all__ = ["PROTOCOL_VERSION", "Message", "Spec", "message", "registry", "message_class",
           "tag_of", "is_terminal", "schema", "equal", "example"]


# --- control and liveness --------------------------------------------------------------------


@message("ping")
class Ping:
    """Round-trip probe; `sent_ns` is echoed back so the sender measures RTT on its own clock."""

    seq: int
    sent_ns: int


@message("pong")
class Pong:
    seq: int
    sent_ns: int
    node_id: str


@message("error")
class ErrorReply:
    """Any refusal; `code` is one of bridge.errors.CODES. The client raises it as ProtocolError."""

    code: str
    message: str


@message("status_request")
class StatusRequest:
    pass


@message("status")
class StatusReply:
    card: AgentCard
    sessions: int
    uptime_s: float
    load: float
    mem_used: int  # bytes
    rss: int  # bytes


@message("batch_status_request")
class BatchStatusRequest:
    """Ask a verifier agent for its continuous batch (the last `recent` iterations)."""

    recent: int = 32


@message("batch_status")
class BatchStatus:
    """A verifier agent's continuous batch: what `macfleet serve` in front of it shows."""

    batching: bool  # False: this verifier runs one session at a time (the rest is empty)
    active: int
    waiting: int
    iterations: int
    recent: tuple[IterationView, ...]  # oldest first
    sessions: tuple[ServedSession, ...]  # live, then recently ended (the agent's own view)


# --- drafting sessions (verifier -> proposer agent) ------------------------------------------


@message("open_session")
class OpenSession:
    """The verifier opens a drafting session on a proposer agent."""

    session_id: str
    proposer: str  # proposer kind, e.g. "ngram", "draft", "layerskip"
    model: str
    prompt: list[int]
    temperature: float
    top_p: float
    seed: int | None
    cross_round: bool  # draft block k+1 while block k is being verified


@message("session_opened")
class SessionOpened:
    session_id: str
    proposer: str
    vocab_size: int


@message("draft_request")
class DraftRequest:
    """Flow F1: the tokens committed since the last request, and how many to draft next."""

    session_id: str
    block: int
    committed: list[int]
    k: int
    want_probs: bool
    # Flow F3, riding with F1 (no extra round trip): the verifier's hidden states for
    # positions features_start.. (the newly committed ones), for hidden-state drafters.
    features: np.ndarray | None = None  # [n, hidden] float16, or int8 with features_scale
    features_start: int = 0
    features_scale: np.ndarray | None = None  # [n] float16: per-row scale of int8 features
    # What became of this proposer's previous draft, so a remote tree drafter calibrates and
    # sizes its trees as a local one does: its accepted tokens (-1: nothing to report), and
    # the verified block's size (root included) and time.
    last_accepted: int = -1
    last_verified: int = 0
    last_verify_ms: float = 0.0
    # The verifier's measured verify(L) (engine/verify_costs.py), with a session's first
    # request: the lengths and their ms.
    verify_lengths: list[int] | None = None
    verify_costs_ms: list[float] | None = None


@message("draft_reply")
class DraftReply:
    """Flow F2: a drafted block; `probs` is [k, vocab] float32 when sampling (lossless accept)."""

    session_id: str
    block: int
    tokens: list[int]
    probs: np.ndarray | None
    draft_ms: float
    predraft_hit: bool  # the block was drafted ahead (cross-round) and its guess held
    # a token tree instead of a chain (EAGLE-2 drafters): parents[i] indexes tokens, -1 = root
    parents: list[int] | None = None


@message("hidden_states")
class HiddenStates:
    """Flow F3: hidden states of accepted tokens (also the payload of bandwidth probes)."""

    session_id: str
    block: int
    positions: list[int]
    states: np.ndarray  # [len(positions), hidden]


@message("hidden_states_ack")
class HiddenStatesAck:
    """The proposer received a HiddenStates message (closes the F3 round trip of a probe)."""

    session_id: str
    block: int
    nbytes: int


@message("close_session")
class CloseSession:
    session_id: str


@message("session_closed")
class SessionClosed:
    session_id: str


# --- drafting ahead (verifier -> a draft-model agent) ----------------------------------------
# A draft-model agent drafts without being asked block by block: after StreamOpen it keeps its
# stream of draft tokens up to `max_lead` past what it knows is committed and pushes each token
# as a DraftChunk the moment it exists, so the verifier finds its next block already there when
# a verify ends. The verifier tells it what it committed (StreamCommit, one-way: no reply).
# Both sides apply the same rule to the same tokens: the stream survives a commit when its
# tokens at the committed positions are the committed ones; otherwise the agent re-roots at
# that commit (`basis` = the commit's seq) and the verifier drops chunks of older bases.


@message("stream_open")
class StreamOpen:
    """Open a draft-ahead session; replies: SessionOpened, then a DraftChunk per drafted token
    (or a few) for as long as the session lives. `model` is the verifier's model spec."""

    session_id: str
    model: str
    prompt: list[int]
    temperature: float
    top_p: float
    seed: int | None
    max_lead: int  # draft at most this many tokens past the committed context


@message("draft_chunk", terminal=False)
class DraftChunk:
    """Flow F2 of a draft-ahead session: tokens at absolute positions start.., drafted from the
    context as of commit `basis` (0: the prompt) and the stream before `start`; `probs` [n, V]
    float32 when sampling. `draft_ms`: the agent's compute time for these tokens."""

    session_id: str
    basis: int
    start: int
    tokens: list[int]
    probs: np.ndarray | None
    draft_ms: float


@message("stream_commit")
class StreamCommit:
    """Flow F1 of a draft-ahead session (one-way): the verifier committed `tokens` at absolute
    positions start..; seq counts the session's commits from 1."""

    session_id: str
    seq: int
    start: int
    tokens: list[int]


# --- generation (client -> verifier agent) ---------------------------------------------------


AUTO_DRAFT_TOKENS = -1  # GenerateRequest.draft_tokens: the verifier picks k per block ("auto")


@message("generate")
class GenerateRequest:
    request_id: str
    prompt: str
    chat: bool  # apply the model's chat template
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    draft_tokens: int  # 0..the engine's MAX_DRAFT_TOKENS, or AUTO_DRAFT_TOKENS
    proposers: list[str]  # ZeroMQ endpoints of proposer agents
    # "auto" (no endpoints): chosen per block on the verifier among its own drafters; an
    # agent older than that refuses it as an unknown drafter (bad_request)
    proposer_spec: str
    cross_round: bool
    # Tokens already committed for this request by a verifier that failed: the new verifier
    # continues after them (greedy: the same ids), so a re-planned session loses and repeats
    # nothing. max_tokens counts them.
    prefix_ids: tuple[int, ...] = ()
    # each committed token's log-probability under the verifier, and this many alternatives
    # (0..MAX_TOP_LOGPROBS) in GenerateChunk; None: not asked (the OpenAI `logprobs` fields)
    top_logprobs: int | None = None
    # the answer must match a grammar (response_format): kind "" (none), "json_object",
    # "json_schema" (source: the schema's JSON), "regex" or "grammar" (source: Lark)
    grammar_kind: str = ""
    grammar_source: str = ""
    # whose prompt cache the request reads and fills on the verifier ("" the shared one; a
    # serve of several API keys sends each key's hash): prefixes cross no partition
    cache_partition: str = ""
    # the answer the client expects (OpenAI's Predicted Outputs), tokenised once by the API
    # server: the verifier's batch drafts from it beside the proposers (MAX_PREDICTION_IDS)
    prediction_ids: tuple[int, ...] = ()


MAX_PREDICTION_IDS = 16384  # GenerateRequest.prediction_ids


MAX_TOP_LOGPROBS = 20  # what the OpenAI API allows for top_logprobs


@message("generate_chunk", terminal=False)
class GenerateChunk:
    request_id: str
    token_ids: list[int]
    text: str
    # with GenerateRequest.top_logprobs: one entry per token of token_ids, in order
    logprobs: tuple[float, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # (token, logprob) alternatives


@message("generate_done")
class GenerateDone:
    request_id: str
    text: str
    token_ids: list[int]
    stats: GenerationStats  # the engine's record, with the verifier agent's `fleet` figures
    cached_tokens: int = 0  # prompt tokens not prefilled: the verifier's prompt cache


# --- prefill/decode disaggregation (verifier -> prefill agent): flow KV ----------------------


@message("prefill_request")
class PrefillRequest:
    """Compute the KV of `prompt` (the verifier feeds the last prompt token itself, so its first
    logits come from its own forward) and stream it back once, in bounded KVChunk messages."""

    session_id: str
    model: str
    prompt: list[int]
    codec: str  # "auto" (the cache's own dtype, exact) | "float16" | "int8" (+ row scales)


@message("kv_chunk", terminal=False)
class KVChunk:
    """Flow KV: layers [layer, layer + n) at positions [start, start + tokens) of the prompt."""

    session_id: str
    layer: int
    start: int
    keys: np.ndarray  # [n_layers, kv_heads, tokens, head_dim]: float32/float16, or int8
    values: np.ndarray
    keys_scale: np.ndarray | None = None  # [n_layers, kv_heads, tokens] float16 (int8 only)
    values_scale: np.ndarray | None = None


@message("prefill_done")
class PrefillDone:
    """The last reply of a prefill: how many chunks were sent (the verifier checks it got them
    all) and what the prefill agent spent computing."""

    session_id: str
    tokens: int
    chunks: int
    kv_bytes: int
    prefill_ms: float


# --- metrics and events (PUB) ----------------------------------------------------------------


@message("block_metrics", terminal=False)
class BlockMetrics:
    """One verified block: what it cost and what each flow moved (bytes and ms)."""

    node_id: str
    session_id: str
    block: int
    k: int
    accepted: int
    block_ms: float
    draft_ms: float
    verify_ms: float
    f1_bytes: int
    f1_ms: float
    f2_bytes: int
    f2_ms: float
    f3_bytes: int
    f3_ms: float
    probe: bool  # F3 measured with a probe payload, no F3 drafter running
    # the verifier's hidden width: what F3 would carry per committed token (float16) when no
    # hidden-state drafter runs, so the dashboard can show F3's cost as an estimate
    hidden_size: int = 0
    # a sharded verifier: what its ranks moved for this block (exact bytes; ms inside the
    # collectives: timed on expert mode's host-routed forwards (prefill chunks), else priced
    # from the ring's measured latency) and the router's load per rank (expert mode)
    shard_bytes: int = 0
    shard_ms: float = 0.0
    shard_priced: bool = False  # shard_ms priced (collectives x the ring's latency), not timed
    rank_load: tuple[int, ...] = ()
    # flow KV, on a session's first block only: its prompt's KV shipped by a prefill agent
    # (bytes, and ms from request to last chunk)
    kv_bytes: int = 0
    kv_ms: float = 0.0
    # a draft-model agent drafting ahead: drafts waiting when the block began (its lead) and
    # the share of its drafts thrown away so far (-1: no such agent)
    ahead_lead: int = 0
    ahead_waste: float = -1.0
    # `--proposer auto` (issue 44): the candidate that drafted this block and why
    # (stats.CHOICE_REASONS); "" for a fixed drafter
    drafter: str = ""
    why: str = ""


@message("agent_event", terminal=False)
class AgentEvent:
    node_id: str
    kind: str
    text: str
    t: float  # unix seconds


# --- tool plane ------------------------------------------------------------------------------


@message("run_preset")
class RunPreset:
    """Run an allowlisted benchmark by name with typed parameters (never a shell string)."""

    preset: str
    params: dict[str, float | int | str]


@message("preset_result")
class PresetResult:
    preset: str
    result_json: str
