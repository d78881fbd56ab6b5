"""Prefill/decode disaggregation: does shipping a prompt's KV from a prefill agent pay?

Prefill is compute-bound and decode bandwidth-bound. On the verifier, a long prompt's prefill
holds its compute thread for the whole prefill, and every session behind it waits. A prefill
agent computes the KV elsewhere and ships it once; what that costs is the KV's bytes over the
measured link (streamed, so it overlaps the prefill agent's compute) and installing it on the
verifier. The verifier's time saved is its local prefill minus the install; the new prompt's
time to first token becomes the slower of the remote prefill and the transfer, plus one chunk.

Pure: one frozen input record -> one frozen decision, with the reason in words either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from macfleet.topology.fleet_spec import Fleet

DEFAULT_MIN_PROMPT_TOKENS = 512  # below this a prefill is one chunk: never worth a round trip
DEFAULT_MIN_SAVED_MS = 200.0  # verifier compute a transfer must free to be worth it
DEFAULT_MAX_TTFT_RATIO = 1.5  # the new prompt's first token may come this much later at most
DEFAULT_CHUNK_TOKENS = 512  # what the prefill agent computes (and ships) at a time
# until measured: a local-area link (1 Gbit/s Ethernet) and the agent's RTT
DEFAULT_LINK_BYTES_PER_S = 110e6
DEFAULT_INSTALL_BYTES_PER_S = 2e9  # copying the received arrays into the cache


@dataclass(frozen=True, kw_only=True)
class DisaggInputs:
    """What the verifier knows when a prompt arrives (measured, or the defaults above)."""

    prompt_tokens: int
    prefill_agents: int  # live prefill agents for this model
    kv_bytes_per_token: int  # K and V of every layer, as the codec sends them
    local_prefill_tok_s: float  # the verifier's own prefill speed
    remote_prefill_tok_s: float  # the prefill agent's (the verifier's until measured)
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    link_rtt_ms: float = 1.0
    install_bytes_per_s: float = DEFAULT_INSTALL_BYTES_PER_S
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    min_saved_ms: float = DEFAULT_MIN_SAVED_MS
    max_ttft_ratio: float = DEFAULT_MAX_TTFT_RATIO


@dataclass(frozen=True, kw_only=True)
class DisaggDecision:
    remote: bool
    reason: str
    local_ms: float = 0.0  # predicted prefill on the verifier
    remote_ms: float = 0.0  # predicted first-token wait with a prefill agent (compute + wire)
    transfer_ms: float = 0.0  # the KV's bytes over the link alone
    saved_ms: float = 0.0  # verifier compute freed
    kv_bytes: int = 0


def decide(x: DisaggInputs) -> DisaggDecision:
    """Prefill on a prefill agent only when it frees enough verifier time and does not make the
    prompt's own first token much later; otherwise locally, saying why."""
    n = max(0, x.prompt_tokens - 1)  # the verifier feeds the last token itself
    kv_bytes = n * x.kv_bytes_per_token
    local_ms = 1e3 * n / x.local_prefill_tok_s if x.local_prefill_tok_s > 0 else 0.0
    if x.prefill_agents <= 0:
        return DisaggDecision(remote=False, reason="no prefill agent in the fleet",
                              local_ms=local_ms, kv_bytes=kv_bytes)
    if x.prompt_tokens < x.min_prompt_tokens:
        return DisaggDecision(
            remote=False, local_ms=local_ms, kv_bytes=kv_bytes,
            reason=f"prompt of {x.prompt_tokens} tokens is under {x.min_prompt_tokens}: "
                   f"prefilled here (~{local_ms:.0f} ms)")
    if x.link_bytes_per_s <= 0 or x.remote_prefill_tok_s <= 0:
        return DisaggDecision(remote=False, reason="link or prefill agent speed unknown (0)",
                              local_ms=local_ms, kv_bytes=kv_bytes)
    transfer_ms = 1e3 * kv_bytes / x.link_bytes_per_s
    compute_ms = 1e3 * n / x.remote_prefill_tok_s
    # streamed per chunk: the slower of compute and wire, plus the last chunk's other half
    chunk = min(n, x.chunk_tokens) / max(n, 1)
    install_ms = 1e3 * kv_bytes / x.install_bytes_per_s
    remote_ms = (max(compute_ms, transfer_ms) + chunk * min(compute_ms, transfer_ms)
                 + x.link_rtt_ms + install_ms)
    saved_ms = local_ms - install_ms
    figures = dict(local_ms=local_ms, remote_ms=remote_ms, transfer_ms=transfer_ms,
                   saved_ms=saved_ms, kv_bytes=kv_bytes)
    mb, link = kv_bytes / 1e6, x.link_bytes_per_s / 1e6
    if saved_ms < x.min_saved_ms:
        return DisaggDecision(
            remote=False, **figures,
            reason=f"prefilling {n} tokens here takes ~{local_ms:.0f} ms; shipping "
                   f"{mb:.1f} MB would free only {saved_ms:.0f} ms (< {x.min_saved_ms:.0f})")
    if remote_ms > x.max_ttft_ratio * local_ms:
        return DisaggDecision(
            remote=False, **figures,
            reason=f"{mb:.1f} MB of KV over {link:.0f} MB/s takes ~{transfer_ms:.0f} ms: the "
                   f"first token would wait ~{remote_ms:.0f} ms against ~{local_ms:.0f} here")
    return DisaggDecision(
        remote=True, **figures,
        reason=f"{n} tokens: prefill agent ~{remote_ms:.0f} ms ({mb:.1f} MB at {link:.0f} MB/s) "
               f"frees ~{saved_ms:.0f} ms of the verifier")


# -- for `macfleet plan`: the decision a fleet would take for long prompts ------------------

PLAN_PROMPT_TOKENS = (2000, 8000)
WIRE_BYTES = 2  # float16 K and V on the wire (the `auto` codec of a float32 or float16 cache)


@dataclass(frozen=True, kw_only=True)
class PlannedDisagg:
    prompt_tokens: int
    verifier: str  # host
    prefill_host: str  # "" when the fleet has no prefill agent
    decision: DisaggDecision


def plan_disagg(fleet: Fleet, prompt_tokens: tuple[int, ...] = PLAN_PROMPT_TOKENS
                ) -> list[PlannedDisagg]:
    """What the verifier's prefill stage would decide for prompts of these sizes on this fleet:
    prefill speed read off the profile's verify(L) curve (its longest measured block, tokens
    per second, on both hosts), KV bytes from the model's shape, the link between the verifier
    host and the best-linked prefill host."""
    hosts = fleet.hosts
    verifier = next((h for h in hosts if not h.roles or "verifier" in h.roles), hosts[0])
    prefills = [h for h in hosts if "prefill" in h.roles and h.name != verifier.name]
    m = fleet.model
    kv_per_token = 2 * m.layers * m.kv_heads * (m.hidden // max(m.heads, 1)) * WIRE_BYTES
    L, ms = max(fleet.profile.verify_ms)
    tok_s = 1e3 * L / ms if ms > 0 else 0.0
    best = max(prefills, key=lambda h: fleet.link(verifier.name, h.name).bandwidth_mb_s,
               default=None)
    link = fleet.link(verifier.name, best.name) if best is not None else None
    out = []
    for n in prompt_tokens:
        x = DisaggInputs(prompt_tokens=n, prefill_agents=len(prefills),
                         kv_bytes_per_token=kv_per_token, local_prefill_tok_s=tok_s,
                         remote_prefill_tok_s=tok_s,
                         **({} if link is None else
                            {"link_bytes_per_s": link.bandwidth_mb_s * 1e6,
                             "link_rtt_ms": link.rtt_ms}))
        out.append(PlannedDisagg(prompt_tokens=n, verifier=verifier.name,
                                 prefill_host=best.name if best is not None else "",
                                 decision=decide(x)))
    return out
