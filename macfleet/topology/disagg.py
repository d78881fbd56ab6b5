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
