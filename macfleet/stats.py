"""What a generation cost and moved: one set of frozen records from the engine to the terminal.

The engine's loops produce a `GenerationStats`; the verifier agent adds a `FleetStats` (where it
ran, what each flow to the proposer agents moved) and sends the same object in
`GenerateDone.stats` (bridge/codec.py validates it field by field, as any nested record); the
CLI prints it with one formatter (cli/cmd_generate.py `print_stats`) whether it ran in-process or
through agents, and `to_dict()` is its JSON form.

The multi-host overhead has one definition and one computation, `multihost_overhead` below: the
verifier agent fills `FleetStats.multihost_overhead` with it (what `generate` prints and `bench`
records), and the dashboard's session view (fleet/metrics.py) applies it to the same blocks'
BlockMetrics, so the two agree for the same blocks.

Plain dataclasses of the standard library only: the one project module that both `bridge` (which
imports no other project package) and `macfleet.engine` (which imports no networking) import.
Records wider than five fields are keyword-only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class BlockFlows:
    """What one verified block moved between the verifier and one remote proposer.

    The round trip cannot be split into its one-way halves without synchronised clocks, so the
    wire time is shared between F1 and F2 in proportion to their bytes (agents/remote_proposer).
    """

    f1_bytes: int = 0
    f2_bytes: int = 0
    f3_bytes: int = 0
    f1_ms: float = 0.0
    f2_ms: float = 0.0
    f3_ms: float = 0.0
    compute_ms: float = 0.0  # the proposer's own drafting time, off the wire
    predraft_hit: bool = False  # the block was drafted ahead (cross-round) and its guess held
    # a draft-model agent drafting ahead: drafts already here when the block began, and the
    # share of its drafts thrown away so far in the session
    ahead_lead: int = 0
    ahead_waste: float = 0.0

    @property
    def wire_ms(self) -> float:
        return self.f1_ms + self.f2_ms + self.f3_ms


def multihost_overhead(wire_ms: float, block_ms: float) -> float:
    """The multi-host overhead of a run of blocks (docs/design.md, "The flows between hosts").

    wire_ms: the critical-path time spent moving F1, F2 and F3 bytes (serialize + wire +
    deserialize while the verifier waits: a remote proposer's round trip minus its own drafting
    time, plus F3's), summed over the blocks; block_ms: the wall time of the same blocks,
    summed. The overhead is their ratio, a share of block time: every verified block counts,
    and one drafted locally or plainly moves nothing, so it adds to block time only. Summing
    before dividing weighs each block by its length (a mean of per-block shares would not).
    The shard flow (collectives inside a sharded verifier's forward, reported per forward) and
    flow KV (once per prompt, not per block) are shown beside it, not in it. 0 without blocks.
    """
    return wire_ms / block_ms if block_ms > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class FlowStats:
    """Per-block averages of the flows to the remote proposers over one generation."""

    remote_blocks: int = 0
    f1_bytes_per_block: float = 0.0
    f2_bytes_per_block: float = 0.0
    f3_bytes_per_block: float = 0.0
    f1_ms_per_block: float = 0.0
    f2_ms_per_block: float = 0.0
    f3_ms_per_block: float = 0.0
    proposer_compute_ms_per_block: float = 0.0
    predraft_hit_rate: float = 0.0
    f3_probe: bool = False  # F3 was measured with probe payloads (no hidden-state drafter ran)
    # a draft-model agent drafting ahead (agents/remote_stream.py): drafts already waiting when
    # a block began (its lead), the share of its pushed drafts thrown away, the verifier's
    # wait for drafts per block, and the agent's compute per draft token (as it reports it)
    ahead_lead: float = 0.0
    ahead_waste: float = 0.0
    ahead_wait_ms: float = 0.0
    ahead_token_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ShardStats:
    """The shard flow of one generation on a sharded verifier (rank 0's view, agents/shard.py).

    collective_bytes is the exact payload of what crosses between ranks during the forwards:
    expert: one all_sum of [tokens, hidden] per MoE layer; tensor: two all-reduces of
    [tokens, hidden] per layer; pipeline: [tokens, hidden] per rank boundary plus the logits
    sent back to rank 0. A ring all-reduce puts 2(N-1)/N of its payload on each rank's link.
    The leader's command broadcasts are counted apart (control_bytes).
    """

    mode: str  # tensor | pipeline | expert
    ranks: int
    forwards: int = 0
    tokens: int = 0  # positions forwarded (prefill chunks + verified blocks)
    collective_bytes: int = 0
    control_bytes: int = 0
    forward_ms: float = 0.0  # wall time of the sharded forwards on rank 0
    collective_ms: float = 0.0  # expert mode: rank 0's time inside the per-layer all_sums of
    # host-routed forwards (prefill chunks); decode forwards keep them inside the graph, untimed
    # every mode: the forwards' collectives priced at the ring's latency as rank 0 measures it
    # on every command broadcast (one small all_sum): collectives x that latency
    priced_ms: float = 0.0
    expert_load: tuple[int, ...] = ()  # expert mode: tokens routed to each expert, all layers
    rank_load: tuple[int, ...] = ()  # expert mode: the same summed over each rank's experts

    @property
    def bytes_per_forward(self) -> float:
        return self.collective_bytes / self.forwards if self.forwards else 0.0

    @property
    def ms_per_forward(self) -> float:
        return self.forward_ms / self.forwards if self.forwards else 0.0

    @property
    def collective_ms_per_forward(self) -> float:
        return self.collective_ms / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), expert_load=list(self.expert_load),
                    rank_load=list(self.rank_load), bytes_per_forward=self.bytes_per_forward,
                    ms_per_forward=self.ms_per_forward,
                    collective_ms_per_forward=self.collective_ms_per_forward)


@dataclass(frozen=True, kw_only=True)
class KVFlow:
    """Flow KV: where a generation's prompt was prefilled, and what shipping its KV cost.

    where: "local" (the verifier computed it), "remote" (a prefill agent did and shipped it
    once) or "fallback" (a prefill agent was tried and failed; the verifier computed it).
    reason: the planner's words for the choice (topology/disagg.py), or the failure."""

    where: str = "local"
    reason: str = ""
    agent: str = ""  # the prefill agent's endpoint
    tokens: int = 0  # prompt positions whose KV was shipped
    codec: str = ""
    kv_bytes: int = 0  # bytes of KV arrays received
    kv_ms: float = 0.0  # request sent -> last chunk received (prefill and wire, overlapped)
    prefill_ms: float = 0.0  # the prefill agent's own compute
    install_ms: float = 0.0  # the verifier putting the received KV into its cache


@dataclass(frozen=True, kw_only=True)
class FleetStats:
    """What a generation through agents adds: who ran it and what crossing hosts cost."""

    verifier: str  # node id of the verifier agent
    flows: FlowStats = FlowStats()
    proposer_failures: int = 0  # proposers dropped (the rest, or plain decoding, went on)
    wire_ms: float = 0.0  # critical-path time spent moving F1/F2/F3 bytes, all blocks
    multihost_overhead: float = 0.0  # `multihost_overhead(wire_ms, the blocks' time)`
    kv: KVFlow = KVFlow()  # flow KV: a long prompt prefilled on a prefill agent
    # names for people, filled in by the client that chose the agents
    verifier_agent: str = ""
    proposer_agents: tuple[str, ...] = ()
    shard: ShardStats | None = None  # a sharded verifier's shard flow and router load


# the name of a request's own prediction among a tree's drafters (OpenAI's Predicted Outputs,
# engine/proposers/prediction.py): its figures are the API's accepted/rejected_prediction_tokens
PREDICTION = "prediction"


@dataclass(frozen=True)
class ProposerStats:
    """One drafter of a token tree: how many of its drafts the verifier kept."""

    name: str
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


# why the drafter of a block was chosen (engine/chooser.py, `--proposer auto`)
PRIOR = "prior"  # the offline record's winner, before its own blocks are measured
BEST = "best"  # the best expected tokens per second measured in this session
EXPLORE = "explore"  # tried now and then at a bounded cost, in case it pays now
FLOOR = "floor"  # plain decoding: drafting lost more than its share of the time against it
CHOICE_REASONS = (PRIOR, BEST, EXPLORE, FLOOR)


@dataclass(frozen=True)
class DrafterChoice:
    """Which candidate drafted a block and why; expected_tok_s: its expected committed tokens
    per second when chosen (0 when unknown: an untried candidate explored)."""

    block: int
    drafter: str
    why: str  # CHOICE_REASONS
    expected_tok_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class BlockTrace:
    """One block of a chosen-while-running drafter as the chooser saw it (engine/chooser.py):
    what it chose and why, what the block cost, and the figures the choice was made on. The
    evidence for why a session drafted as it did (`bench drafter` records it per block).

    best: the candidate of best expected rate when chosen (the drafter differs when it was
    explored, or kept by the switch margin); table_ms: the verify(L) table's entry for this
    block's length and load: the machine's factor on it, both as they stood before the block
    (expected verify = table_ms * load); rates: every candidate's expected committed tokens
    per second when chosen (0: unknown)."""

    block: int
    drafter: str
    why: str  # CHOICE_REASONS
    best: str
    length: int  # tokens verified (drafts + 1)
    accepted: int
    draft_ms: float
    verify_ms: float  # measured
    table_ms: float
    load: float
    rates: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DrafterStats:
    """One candidate of a chosen-while-running drafter: the blocks it drafted (of which
    explored) and the tokens they committed."""

    name: str
    blocks: int = 0
    explored: int = 0
    committed: int = 0


@dataclass(frozen=True, kw_only=True)
class GenerationStats:
    tokens: int = 0
    elapsed_s: float = 0.0
    prefill_ms: float = 0.0
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    proposer: str = "none"
    finish_reason: str = ""
    accepted_hist: tuple[int, ...] = ()  # blocks with k > 0, by accepted length
    per_proposer: tuple[ProposerStats, ...] = ()  # token trees: each drafter's share
    # `--proposer auto`: each candidate's blocks, and which drafted each block and why
    drafters: tuple[DrafterStats, ...] = ()
    choices: tuple[DrafterChoice, ...] = ()
    trace: tuple[BlockTrace, ...] = ()  # ... and what the chooser saw, block by block
    fleet: FleetStats | None = None  # set by the verifier agent; None in-process

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prompt was processed (what mlx-lm reports)."""
        t = self.elapsed_s - self.prefill_ms / 1e3
        return self.tokens / t if t > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        n = sum(self.accepted_hist)
        return sum(i * c for i, c in enumerate(self.accepted_hist)) / n if n else 0.0

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """(accepted, rejected) tokens of the request's prediction: its drafts on the accepted
        paths, and those verified and not accepted ((0, 0) without a prediction)."""
        mine = [p for p in self.per_proposer if p.name == PREDICTION]
        accepted = sum(p.accepted for p in mine)
        return accepted, sum(p.drafted for p in mine) - accepted

    def acceptance_of(self, name: str) -> float:
        """The acceptance of the tree drafter called `name`; KeyError when none is."""
        for p in self.per_proposer:
            if p.name == name:
                return p.acceptance
        raise KeyError(name)

    def to_dict(self) -> dict:
        """The JSON form (`generate --json`): every field, nested as the records are, plus the
        derived rates."""
        d = asdict(self)
        d["accepted_hist"] = list(self.accepted_hist)
        d["per_proposer"] = [dict(asdict(p), acceptance=p.acceptance) for p in self.per_proposer]
        if self.fleet is not None:
            d["fleet"]["proposer_agents"] = list(self.fleet.proposer_agents)
            if self.fleet.shard is not None:
                d["fleet"]["shard"] = self.fleet.shard.to_dict()
        d.update(tokens_per_s=self.tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s, acceptance=self.acceptance,
                 mean_accepted=self.mean_accepted)
        return d




# -- a continuous batch (the server's or a verifier agent's), iteration by iteration ------

# a session's life on the server: waiting for a slot, feeding its prompt, decoding, then gone
SESSION_STATES = ("queued", "prefill", "decode", "done", "cancelled", "failed")


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True, slots=True)
class IterationView:
    """One forward over the flat batch: who was in it and how many tokens of each kind."""

    t: float  # the engine's clock (s): only differences between iterations mean anything
    sessions: int
    decode_tokens: int  # speculative blocks (1 + drafts each)
    prefill_tokens: int  # prompt chunks
    queued: int  # sessions waiting for a slot when it ran
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IterationView:
        return cls(t=float(d["t"]), sessions=int(d["sessions"]),
                   decode_tokens=int(d["decode_tokens"]), prefill_tokens=int(d["prefill_tokens"]),
                   queued=int(d["queued"]), ms=float(d["ms"]))


@dataclass(frozen=True, slots=True)
class ServedSession:
    """One request's session: progress, time to first token and inter-token latency.

    Latencies are what the client sees: TTFT from the moment the request was queued, and the
    gaps between committed blocks (a block can carry several tokens), as bench serve measures
    them between streamed chunks."""

    sid: int
    state: str  # one of SESSION_STATES
    prompt_tokens: int
    prefill_left: int
    generated: int
    ttft_ms: float | None  # None: no token yet
    itl_p50_ms: float | None  # None: fewer than two blocks
    itl_p99_ms: float | None
    accepted: int
    drafted: int

    @property
    def active(self) -> bool:
        return self.state in ("queued", "prefill", "decode")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedSession:
        return cls(sid=int(d["sid"]), state=str(d["state"]),
                   prompt_tokens=int(d["prompt_tokens"]), prefill_left=int(d["prefill_left"]),
                   generated=int(d["generated"]), ttft_ms=_opt_float(d.get("ttft_ms")),
                   itl_p50_ms=_opt_float(d.get("itl_p50_ms")),
                   itl_p99_ms=_opt_float(d.get("itl_p99_ms")),
                   accepted=int(d["accepted"]), drafted=int(d["drafted"]))


__all__ = ["multihost_overhead", "BlockFlows", "FlowStats", "ShardStats", "FleetStats",
           "ProposerStats", "GenerationStats", "SESSION_STATES", "IterationView", "ServedSession"]
