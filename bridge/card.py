"""The agent card: what an agent says about itself (Zeroconf TXT and status replies).

A card is public: it carries a fleet *id* (a hash of the fleet key), never the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# 2: GenerateDone.stats is a typed GenerationStats (was a flat dict); 3: the prefill role
# (PrefillRequest, KVChunk, PrefillDone) and FleetStats.kv; 4: logprobs through a fleet
# (GenerateRequest.top_logprobs, GenerateChunk.logprobs / top, GenerateDone.cached_tokens)
# and structured output (GenerateRequest.grammar_kind / grammar_source); 5: card tags carry a
# time stamp (x-ts, bridge.peers), GenerateRequest.cache_partition (one prompt cache per API
# key of a serve in front of the fleet) and GenerateRequest.prediction_ids (OpenAI's Predicted
# Outputs), and draft-model agents' messages (StreamOpen, DraftChunk, StreamCommit)
PROTOCOL_VERSION = 5
SERVICE_TYPE = "_macfleet._tcp.local."

ROLE_PROPOSER = "proposer"
ROLE_VERIFIER = "verifier"
ROLE_SHARD = "shard"
ROLE_PREFILL = "prefill"  # computes long prompts' KV for a verifier (flow KV)
ROLES = (ROLE_PROPOSER, ROLE_VERIFIER, ROLE_SHARD, ROLE_PREFILL)


# A draft-model agent (`agent --role proposer --draft MODEL`) serves this one drafter kind and
# names its draft model under this extra: a client then drafts with it by default
AHEAD_KIND = "draft"
CARD_DRAFT = "draft"


def draft_label(spec: str) -> str:
    """A draft model's name for a card: a path's last part (TXT entries are short)."""
    return spec.rstrip("/").rsplit("/", 1)[-1][:60] or spec[:60]


@dataclass(frozen=True)
class AgentCard:
    """Identity and capabilities of one agent (one per Mac, or several on one machine)."""

    node_id: str
    name: str
    fleet_id: str
    host: str  # IP address clients connect to
    router_port: int  # ZeroMQ ROUTER: requests
    pub_port: int  # ZeroMQ PUB: metrics and events
    roles: tuple[str, ...] = ()
    chip: str = ""
    mem_total: int = 0  # bytes
    mem_free: int = 0  # bytes
    models: tuple[str, ...] = ()  # model specs loaded (or loadable on demand)
    proposers: tuple[str, ...] = ()  # proposer kinds served, e.g. ("layerskip", "ngram", "draft")
    protocol: int = PROTOCOL_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())

    @property
    def draft_model(self) -> str:
        """The draft model of a draft-model agent ("" for any other agent)."""
        return dict(self.extra).get(CARD_DRAFT, "")

    @property
    def router_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.router_port}"

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.pub_port}"
