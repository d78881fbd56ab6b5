"""Generate the recorded fleet snapshots the dashboard tests replay.

Run ``python3 tests/tui/make_fixtures.py`` after changing the snapshot format; a test
checks the committed files match what this script produces.  Numbers are plausible for
SmolLM2/Qwen-sized models on a small desk fleet, and fully deterministic (no clock, no RNG).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, str(ROOT))

from macfleet.fleet.snapshot import (  # noqa: E402
    BlockSample, FleetEvent, FleetSnapshot, FlowView, HostView, LinkView, SessionView,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
GIB = 1024**3
FLEET = "desk-lab"


def host(node_id: str, name: str, chip: str, roles: tuple[str, ...], models: tuple[str, ...],
         mem: tuple[float, int], load: float, rtt: float | None, *, alive: bool = True,
         hb: float = 0.4, octet: int = 10) -> HostView:
    return HostView(node_id=node_id, name=name, chip=chip, roles=roles, models=models,
                    mem_used=int(mem[0] * GIB), mem_total=mem[1] * GIB, load=load,
                    heartbeat_age_s=hb, rtt_ms=rtt, alive=alive,
                    address=f"tcp://192.168.1.{octet}:5755")


def studio(i: int = 0) -> HostView:
    return host("n-studio", "studio", "M2 Ultra", ("verifier",),
                ("Qwen2.5-7B-Instruct-4bit",), (9.8 + 0.1 * i, 192), 0.61, 0.05, octet=10)


def air(i: int = 0) -> HostView:
    return host("n-air", "air", "M3", ("proposer",), ("SmolLM2-135M",),
                (1.2, 16), 0.34 + 0.01 * i, round(1.9 + 0.1 * math.sin(i), 3), octet=21)


def mini(i: int = 0, *, alive: bool = True, hb: float = 0.6) -> HostView:
    return host("n-mini", "mini", "M4", ("proposer",), ("SmolLM2-135M",),
                (1.1, 24), 0.12, 0.9 if alive else None, alive=alive, hb=hb, octet=33)


def timeline(i: int, k: int = 4, n: int = 12) -> tuple[BlockSample, ...]:
    out = []
    for b in range(max(0, 8 * i + 20 - n), 8 * i + 20):
        acc = (b * 7 + 3) % (k + 1)
        draft, verify, wire = 4.1 + 0.2 * (b % 3), 31.0 + acc, 2.4 + 0.3 * (b % 2)
        out.append(BlockSample(block=b, k=k, accepted=acc, block_ms=draft + verify + wire,
                               draft_ms=draft, verify_ms=verify, wire_ms=wire))
    return tuple(out)


def session(i: int, sid: str = "s-7f3a", *, proposers: tuple[str, ...] = ("air",),
            active: bool = True) -> SessionView:
    hist = (3 + i, 5 + i, 9 + 2 * i, 12 + 3 * i, 7 + 2 * i)
    # rounded so the recording is byte-identical whatever libm computes sin/cos
    hist_f1 = tuple(round(0.02 + 0.002 * ((i + j) % 4), 4) for j in range(16))
    hist_f2 = tuple(round(1.1 + 0.3 * math.sin((i + j) / 2), 4) for j in range(16))
    hist_f3 = tuple(round(5.6 + 0.8 * math.cos((i + j) / 3), 4) for j in range(16))
    flows = (
        FlowView("F1", 12.0, 0.02, 0.0005, False, hist_f1),
        FlowView("F2", 48.0, hist_f2[-1], hist_f2[-1] / 38.0, False, hist_f2),
        # EAGLE-sized hidden states of Qwen-7B (3584 wide, 5 tokens, bf16), only probed
        FlowView("F3", 3584 * 5 * 2.0, hist_f3[-1], hist_f3[-1] / 38.0, True, hist_f3),
    )
    blocks = 20 + 8 * i
    n = sum(hist)
    mean = sum(j * c for j, c in enumerate(hist)) / n
    return SessionView(session_id=sid, verifier="studio", proposers=proposers,
                       topology="2p:1v" if len(proposers) > 1 else "1p:1v",
                       tokens_per_s=61.5 + i, acceptance=mean / 4, mean_accepted=mean,
                       draft_len=4, blocks=blocks, accepted_hist=hist, flows=flows,
                       timeline=timeline(i), overhead_share=(0.02 + hist_f2[-1]) / 38.0,
                       active=active)


def links(names: tuple[str, ...]) -> tuple[LinkView, ...]:
    base = {"air": 1.9, "mini": 0.9, "studio": 0.05}
    return tuple(LinkView(a, b, base[a] + base[b], 2.5 * (base[a] + base[b]))
                 for a in names for b in names if a < b)


def ev(dt: float, kind: str, text: str) -> FleetEvent:
    return FleetEvent(T0 + dt, kind, text)


def two_hosts() -> list[FleetSnapshot]:
    """A verifier and one proposer, generating: F1/F2 rows and an F3 probe row."""
    events = [ev(0.0, "join", "studio joined (M2 Ultra, verifier)"),
              ev(0.5, "join", "air joined (M3, proposer)"),
              ev(1.5, "session", "s-7f3a started: studio verifies, air drafts")]
    return [FleetSnapshot(T0 + 2 + i, FLEET, (studio(i), air(i)), links(("air", "studio")),
                          (session(i),), tuple(events[-3:]))
            for i in range(6)]


def host_vanishes() -> list[FleetSnapshot]:
    """Three hosts; mini loses its heartbeat (alive=False), then leaves the fleet."""
    joins = (ev(0.0, "join", "studio joined (M2 Ultra, verifier)"),
             ev(0.2, "join", "air joined (M3, proposer)"),
             ev(0.4, "join", "mini joined (M4, proposer)"))
    lost = ev(4.0, "heartbeat_lost", "mini: no heartbeat for 3.0s")
    gone = ev(8.0, "leave", "mini left (heartbeat timeout)")
    all3 = ("air", "mini", "studio")
    sess = session(1, proposers=("air", "mini"))
    return [
        FleetSnapshot(T0 + 3, FLEET, (studio(1), air(1), mini(1)), links(all3), (sess,), joins),
        FleetSnapshot(T0 + 5, FLEET, (studio(2), air(2), mini(2, alive=False, hb=4.2)),
                      links(all3), (session(2, proposers=("air", "mini")),), joins + (lost,)),
        FleetSnapshot(T0 + 9, FLEET, (studio(3), air(3)), links(("air", "studio")),
                      (session(3),), joins + (lost, gone)),
    ]


def empty_fleet() -> list[FleetSnapshot]:
    """Discovery running, nobody answered yet."""
    return [FleetSnapshot(T0 + i, FLEET) for i in range(2)]


SCENARIOS = {"two_hosts": two_hosts, "host_vanishes": host_vanishes, "empty_fleet": empty_fleet}


def render_all() -> dict[str, str]:
    """File name -> exact JSON-lines text, for writing and for the up-to-date check."""
    return {f"{name}.jsonl": "".join(s.to_json() + "\n" for s in make())
            for name, make in SCENARIOS.items()}


def main() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for fname, text in render_all().items():
        (FIXTURES / fname).write_text(text, encoding="utf-8")
        print(f"wrote {FIXTURES / fname} ({text.count(chr(10))} snapshots)")


if __name__ == "__main__":
    main()
