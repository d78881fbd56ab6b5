"""`macfleet demo`: the README's main job.

Starts a 2-agent local fleet on the embedded model (its own key and run directory, so it does
not touch a fleet you run), asks the verifier agent for a chat answer alone and with
speculative decoding drafted by the proposer agent, in interleaved rounds (a 64-token answer
takes ~3 s, and one run of each swings by 10-20% on a shared machine: the faster of each
side's rounds is compared, as `timeit` does), prints the text and the statistics with the
speedup measured in this run, and shuts the fleet down.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from macfleet.cli.common import DEFAULT_PROPOSER, UserError

# An ordinary question (nothing in it for a drafter to copy), never used in training.
DEMO_PROMPT = "What are three simple ways to save energy at home?"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="local 2-agent fleet: speculative decoding across agents")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the chat message")
    p.add_argument("--proposer", default=DEFAULT_PROPOSER, help="the proposer agent's drafter "
                   "(auto: the drafter measured best for the model, as for `generate`)")
    p.add_argument("--model", default="smollm2", help="the model both agents serve")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length cap, in tokens")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each (alone, "
                   "with drafts); the faster run of each side is compared")
    p.set_defaults(func=run)


def _collect(card, key, **kw):
    from macfleet.fleet.client import Done, generate

    for ev in generate(card, key, **kw):
        if isinstance(ev, Done):
            return ev
    raise UserError("the verifier ended the stream without a result")


def run(args) -> int:
    from macfleet.cli.cmd_generate import print_stats
    from macfleet.fleet import local
    from macfleet.fleet.client import Refused, VerifierFailed, verifier_and_proposer
    from macfleet.fleet.keys import keygen

    from macfleet.engine.proposers.choice import FLEET, resolve_proposer

    args.proposer, why = resolve_proposer(args.proposer, args.model, FLEET)
    print(f"drafter: {args.proposer} ({why})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="macfleet-demo-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        print("starting a local fleet: 1 verifier + 1 proposer agent ...", file=sys.stderr)
        try:
            cards = local.up(2, model=args.model, key=key, key_path=key_path,
                             run_dir=Path(tmp) / "run", tied=True)
        except local.FleetStartError as e:
            raise UserError(str(e)) from None
        try:
            v, p = verifier_and_proposer(cards)
            print(f"discovered over Zeroconf: {v.name} at {v.router_endpoint}, {p.name} at "
                  f"{p.router_endpoint}", file=sys.stderr)
            common = dict(prompt=args.prompt, max_tokens=args.max_tokens)
            _collect(v, key, prompt="Hi", max_tokens=4)  # warm-up
            alones, specs = [], []
            for _ in range(max(1, args.repeats)):
                alones.append(_collect(v, key, proposers=[], proposer_spec="none", **common))
                # one proposer agent serves every branch of the tree (one session per branch)
                specs.append(_collect(v, key, proposers=[p], proposer_spec=args.proposer,
                                      **common))
        except (Refused, VerifierFailed) as e:
            raise UserError(f"fleet request failed: {e}") from None
        finally:
            local.down(Path(tmp) / "run")
    alone = max(alones, key=lambda d: d.stats.tokens_per_s)
    spec = max(specs, key=lambda d: d.stats.tokens_per_s)
    print(f"\nprompt: {args.prompt}\n")
    print(spec.text)
    st = spec.stats  # where it ran is filled in by the fleet client
    print_stats(st, file=sys.stdout)
    a = alone.stats
    same = all(d.token_ids == alones[0].token_ids for d in alones + specs)
    print(f"   verifier alone: {a.tokens_per_s:.1f} tok/s -> with the proposer agent: "
          f"{st.tokens_per_s:.1f} tok/s = {st.tokens_per_s / a.tokens_per_s:.2f}x "
          f"(the faster of {len(alones)} interleaved runs each: alone "
          f"{', '.join(f'{d.stats.tokens_per_s:.1f}' for d in alones)}, with drafts "
          f"{', '.join(f'{d.stats.tokens_per_s:.1f}' for d in specs)} tok/s); output "
          f"{'identical' if same else 'DIFFERENT (bug!)'} to the verifier alone")
    return 0 if same else 1
