"""`macfleet generate`: one prompt, speculative decoding, text and statistics."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from macfleet.cli.common import (DEFAULT_PROPOSER, UserError, add_key_args,
                                 parse_draft_tokens, sampling_params)
from macfleet.cli import where as W
from macfleet.engine.controller import AUTO, MAX_DRAFT_TOKENS
from macfleet.stats import GenerationStats

MODEL_HELP = ("smollm2 (the embedded SmolLM2-135M-Instruct) | PATH.gguf | mlx-lm directory | "
              "Hugging Face ORG/NAME (needs internet) | tiny:SEED[:VOCAB] | "
              "tiny-moe:SEED[:VOCAB]")
PROPOSER_HELP = (f"the drafter: {AUTO} | eagle2[:PATH] | eagle[:PATH] | ngram[:N] | retrieval | "
                 "layerskip:K | draft:MODEL | none; several joined by + draft a token tree each "
                 f"block ({AUTO}: chosen block by block among the model's drafters and plain "
                 "decoding, starting from the one `macfleet bench drafter --record` measured "
                 "best; through agents, by the verifier agent among its own drafters, or a "
                 "fleet's draft-model agents drafting ahead)")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="answer one prompt (through the fleet when there is one)",
                       description="Answer one prompt with speculative decoding: through the "
                       "fleet's agents when a verifier for the model is found, else in this "
                       "process. One line on stderr says which, and why.")
    p.add_argument("prompt", help="the prompt (a chat message unless --no-chat)")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--proposer", default=DEFAULT_PROPOSER, help=PROPOSER_HELP)
    p.add_argument("--draft-tokens", default=AUTO,
                   help=f"tokens drafted per block: K (0..{MAX_DRAFT_TOKENS}) or {AUTO} (adapts "
                   "to the acceptance measured as it runs)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap, in tokens")
    p.add_argument("--temp", type=float, default=0.0,
                   help="sampling temperature (0: greedy, the verifier's own argmax)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a random one; sampling only)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, stats with `where`)")
    p.add_argument("--local", action="store_true",
                   help="in this process: do not look for a fleet")
    p.add_argument("--response-format", default=None, metavar="JSON",
                   help="the answer must match it: the API's response_format, e.g. "
                   "'{\"type\": \"json_object\"}', json_schema, or regex / grammar (Lark) "
                   "(default: free text)")
    p.add_argument("--no-cross-round", action="store_true",
                   help="fleet: the proposer does not pre-draft the next block")
    add_key_args(p, open_help="talk to an unauthenticated fleet")
    p.add_argument("--wait", type=float, default=2.0,
                   help="seconds to look for agents before answering in-process")
    p.set_defaults(func=run)


def result_json(stats: GenerationStats, text: str, token_ids, where: W.Where) -> str:
    """The one JSON object of `generate --json` (in-process and fleet alike); `stats.where`
    says where it ran and why, as the stderr line does."""
    return json.dumps({"text": text, "token_ids": list(token_ids),
                       "stats": {**stats.to_dict(), "where": where.to_dict()}})


def print_stats(stats: GenerationStats, file=None) -> None:
    """The statistics of a run, in-process or through agents (then with where it ran and
    what the flows between hosts cost); on stderr unless `file`."""
    file = file or sys.stderr
    fleet = stats.fleet
    where = f" on {','.join(fleet.proposer_agents) or '-'}" if fleet is not None else ""
    print(f"\n-- {stats.tokens} tokens in {stats.elapsed_s:.2f}s: {stats.tokens_per_s:.1f} tok/s "
          f"(decode {stats.decode_tokens_per_s:.1f}) | proposer {stats.proposer}{where} | "
          f"acceptance {stats.acceptance:.0%} | mean accepted {stats.mean_accepted:.2f} | blocks "
          f"{stats.blocks} | draft {stats.draft_ms:.0f} ms, verify {stats.verify_ms:.0f} ms",
          file=file)
    for p in stats.per_proposer:
        print(f"   acceptance[{p.name}]: {p.acceptance:.3f}", file=file)
    if stats.drafters:  # `auto`: which candidate drafted how many blocks (--json: each block)
        print("   drafted by: " + ", ".join(
            f"{d.name} {d.blocks} blocks ({d.explored} explored), {d.committed} tokens"
            for d in stats.drafters if d.blocks), file=file)
    if fleet is None:
        return
    print(f"   verifier {fleet.verifier_agent or fleet.verifier} | proposer failures "
          f"{fleet.proposer_failures}", file=file)
    f = fleet.flows
    if f.remote_blocks:
        print(f"   flows/block: F1 {f.f1_bytes_per_block:.0f} B {f.f1_ms_per_block:.2f} ms | "
              f"F2 {f.f2_bytes_per_block:.0f} B {f.f2_ms_per_block:.2f} ms | F3 "
              f"{f.f3_bytes_per_block:.0f} B {f.f3_ms_per_block:.2f} ms | multi-host overhead "
              f"{fleet.multihost_overhead:.1%} | pre-draft hits {f.predraft_hit_rate:.0%}",
              file=file)
    sh = fleet.shard
    if sh is not None:
        print(f"   shard flow ({sh.mode} over {sh.ranks}): {sh.bytes_per_forward:.0f} B/forward, "
              f"{sh.ms_per_forward:.1f} ms/forward over {sh.forwards} forwards"
              + (f", collective {sh.collective_ms_per_forward:.2f} ms" if sh.collective_ms else "")
              + (f", collectives ~{sh.priced_ms / sh.forwards:.2f} ms/forward priced at the "
                 "ring's latency" if sh.priced_ms and sh.forwards else "")
              + (f" | router load per rank {list(sh.rank_load)}, per expert "
                 f"{list(sh.expert_load)}" if sh.expert_load else ""), file=file)
    kv = fleet.kv
    if kv.where != "local" or kv.reason:  # flow KV: the prompt's prefill, where and why
        print(f"   flow KV: prefill {kv.where}" + (
            f" on {kv.agent}: {kv.tokens} tokens, {kv.kv_bytes / 1e6:.1f} MB ({kv.codec}) in "
            f"{kv.kv_ms:.0f} ms (agent compute {kv.prefill_ms:.0f} ms, install "
            f"{kv.install_ms:.0f} ms)" if kv.where == "remote" else "")
            + (f" | {kv.reason}" if kv.reason else ""), file=file)


def run_local(args, where: W.Where) -> int:
    from macfleet.engine.events import Finished
    from macfleet.cli.common import load_model
    from macfleet.engine.models import ModelSpecError
    from macfleet.engine.proposers import ProposerSpecError, parse_proposer_spec
    from macfleet.engine.text import PromptError, TextDelta
    from macfleet.serve.one import GenerationFailed, generate_one

    params = sampling_params(args)
    k = parse_draft_tokens(args.draft_tokens)
    if args.max_tokens < 0:
        raise UserError("--max-tokens must be >= 0")
    try:
        for spec in args.proposer.split("+") if args.proposer != AUTO else ():
            parse_proposer_spec(spec)
        print(where.line(), file=sys.stderr, flush=True)
        lm = load_model(args.model)
        parts: list[str] = []
        for ev in generate_one(lm, args.prompt, chat=not args.no_chat, proposer=args.proposer,
                               draft_tokens=k, max_tokens=args.max_tokens, params=params,
                               grammar=response_grammar(args)):
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
                if not args.json:
                    print(ev.text, end="", flush=True)
            elif isinstance(ev, Finished):
                if args.json:
                    print(result_json(ev.stats, "".join(parts), ev.token_ids, where))
                else:
                    print()
                    print_stats(ev.stats)
    except (ModelSpecError, ProposerSpecError, PromptError, ValueError, GenerationFailed) as e:
        raise UserError(str(e)) from None
    return 0


@dataclass
class Progress:
    """What the client has received for a request: survives a re-plan."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def response_grammar(args):
    """--response-format as a Grammar (None without it); a UserError naming what is wrong."""
    if args.response_format is None:
        return None
    from macfleet.serve.schemas import RequestError, response_format

    try:
        return response_format(json.loads(args.response_format))
    except json.JSONDecodeError as e:
        raise UserError(f"--response-format is not JSON: {e}") from None
    except RequestError as e:
        raise UserError(f"--response-format: {e.message}") from None


def validate(args) -> None:
    """Cheap argument checks first, so a typo costs no model load (or fleet discovery)."""
    from macfleet.engine.models import ModelSpecError, check_spec

    try:
        check_spec(args.model)
    except ModelSpecError as e:
        raise UserError(f"--model: {e}") from None
    sampling_params(args)
    response_grammar(args)
    parse_draft_tokens(args.draft_tokens)
    if args.max_tokens < 0:
        raise UserError("--max-tokens must be >= 0")


def run(args) -> int:
    validate(args)
    from macfleet.engine.proposers.choice import resolve_proposer

    asked = args.asked_proposer = args.proposer
    # `auto` is the drafter chosen block by block (engine/choosing.py), with the bench record
    # as its prior: in this process, or through a fleet on the verifier agent among its own
    # drafters (draft-model agents drafting ahead still draft where the fleet has them)
    args.proposer = AUTO if asked == AUTO else resolve_proposer(asked, args.model)[0]
    if args.local:
        return run_local(args, W.asked_local())
    from macfleet.cli.common import fleet_key_if_any
    from macfleet.fleet.keys import KeyMissing, default_key_path

    try:
        key = fleet_key_if_any(args)
    except KeyMissing:  # no fleet key on this machine: no fleet to talk to
        return run_local(args, W.no_key(str(default_key_path())))
    args.fleet_proposer = asked  # `auto` goes to the verifier agent as it is
    committed = Progress()
    try:
        return _replanning(args, key, committed)
    except UserError as e:
        if args.json and committed.ids:  # what was received is kept, with why it stopped
            print(json.dumps({"text": "".join(committed.text), "token_ids": committed.ids,
                              "complete": False, "error": str(e)}))
        raise


def _replanning(args, key, committed: Progress) -> int:
    """Through the fleet (macfleet.fleet.client.generate_fleet re-plans when a verifier is
    lost); in-process when it has no verifier. committed: what was received, kept on failure."""
    from macfleet.fleet.client import (Done, NoFleet, Placed, ProposerRefused, Refused,
                                       Replanned, Text, VerifierFailed, fleet_id,
                                       generate_fleet)

    params = sampling_params(args)
    grammar = response_grammar(args)
    where = None
    try:
        for ev in generate_fleet(
                key, args.model, wait_s=args.wait, proposer_spec=args.fleet_proposer,
                draft_agents=args.asked_proposer in ("auto", "draft"),
                prompt=args.prompt, chat=not args.no_chat, max_tokens=args.max_tokens,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                draft_tokens=parse_draft_tokens(args.draft_tokens),
                cross_round=not args.no_cross_round,
                # a re-plan resumes the grammar after the tokens already committed (the new
                # verifier's constraint advances over them: engine/constraint.py `resume`)
                grammar=(grammar.kind, grammar.source) if grammar is not None else ("", "")):
            if isinstance(ev, Placed):
                where = W.in_fleet(ev.fleet_id, ev.verifier, ev.proposers)
                print(where.line(), file=sys.stderr, flush=True)
            elif isinstance(ev, Text):
                committed.ids.extend(ev.token_ids)
                committed.text.append(ev.text)
                if not args.json:
                    print(ev.text, end="", flush=True)
            elif isinstance(ev, Replanned):
                print(f"macfleet: {ev.why}; re-planning on the rest of the fleet",
                      file=sys.stderr)
            elif isinstance(ev, ProposerRefused):
                print(f"macfleet: {ev.why}", file=sys.stderr)
            elif isinstance(ev, Done):
                if args.json:
                    print(result_json(ev.stats, ev.text, ev.token_ids, where))
                else:
                    print()
                    print_stats(ev.stats)
    except NoFleet as e:
        return run_local(args, W.no_fleet(fleet_id(key), args.wait, e.seen, str(e)))
    except (Refused, VerifierFailed) as e:
        raise UserError(str(e) + older_agent_hint(args.fleet_proposer, str(e))) from None
    return 0


def older_agent_hint(spec: str, error: str) -> str:
    """Pure: why a verifier agent refused `auto` when it is older than the chooser on agents
    (it checks `auto` as a drafter name); "" otherwise."""
    if spec == AUTO and f"unknown proposer '{AUTO}'" in error:
        return (f" (that verifier agent predates `--proposer {AUTO}` chosen on the agent: "
                "update it, or name a drafter, e.g. --proposer eagle)")
    return ""
