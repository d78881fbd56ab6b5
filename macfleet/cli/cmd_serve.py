"""`macfleet serve`: an OpenAI-compatible HTTP API, continuous batching of speculative blocks."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from macfleet.cli.common import DEFAULT_PROPOSER, UserError, add_key_args, parse_draft_tokens
from macfleet.serve.scheduler import DEFAULT_STALL_RATIO

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
SOCKET_BACKLOG = 2048  # uvicorn's default
DEFAULT_PROMPT_CACHE_MB = 512  # finished requests' KV kept for later prompts (serve/prompt_cache.py)


def add_front_options(p, *, wait_s: float = 2.0, batch_sessions: bool = True
                      ) -> tuple[str, ...]:
    """The options of the HTTP front and of its sessions on a fleet: one builder for `serve`
    and `up --serve` (which takes every one of them; batch_sessions=False where the parser has
    its own `--batch-sessions`, as `up` does for its verifier agent: the same idea, one flag).
    Returns their `dest`s."""
    acts = [p.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (0.0.0.0: every interface)"),
            p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")]
    key = p.add_mutually_exclusive_group()
    acts += [key.add_argument("--api-key", action="append", default=None, metavar="KEY",
                              help="require 'Authorization: Bearer KEY'; repeat it for several "
                              "keys (a team): each key then has a prompt cache of its own, so "
                              "one key's prompts never show in another's cached_tokens or time "
                              "to first token (default: $MACFLEET_API_KEY, else none)"),
             key.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                              help="the API keys, one a line (as --api-key; default: none)"),
             p.add_argument("--proposer", default=DEFAULT_PROPOSER,
                            help="each session's drafter: auto | eagle2 | eagle | ngram[:N] | "
                            "retrieval | layerskip:K | draft:MODEL | none, or several joined by "
                            "'+' (a token tree per block, verified in the batch like the "
                            "chains); auto, as for `generate`: the drafter measured best for "
                            "the model (ngram with --batch-invariant), or the fleet's "
                            "draft-model agents when it has some"),
             p.add_argument("--draft-tokens", default="auto",
                            help="tokens drafted per block: K, or auto (adapts as it runs)")]
    if batch_sessions:
        acts.append(p.add_argument("--batch-sessions", type=int, default=16,
                                   help="sessions verified together in one batch "
                                   "(continuous batching)"))
    acts += [p.add_argument("--max-queue", type=int, default=64,
                            help="sessions waiting for a slot"),
             p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                            help="a Jinja chat template replacing the model's own (e.g. one with "
                            "tool support: tools are rendered by it and its tool-call format is "
                            "parsed; default: the model's own)"),
             p.add_argument("--max-tokens-cap", type=int, default=1024,
                            help="the largest max_tokens a request may ask for"),
             p.add_argument("--max-prompt-tokens", type=int, default=4096,
                            help="longer prompts are refused (400)"),
             p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                            help="larger request bodies are refused (413)"),
             p.add_argument("--max-sessions-per-client", type=int, default=16,
                            help="open sessions per client address"),
             p.add_argument("--wait", type=float, default=wait_s,
                            help="seconds to look for agents before serving in-process")]
    return tuple(a.dest for a in acts)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API (continuous batching)")
    p.add_argument("--local", action="store_true",
                   help="in-process verifier with continuous batching (default when no fleet "
                   "is found); without it a fleet's verifier agent serves each request")
    p.add_argument("--model", default="smollm2", help="the model served (see `macfleet "
                   "generate --help` for the specs)")
    add_front_options(p)
    e = p.add_argument_group("the in-process verifier (serve --local, or no fleet found)")
    e.add_argument("--token-budget", type=int, default=256,
                   help="tokens per iteration (bounds prefill chunks)")
    e.add_argument("--no-chunked-prefill", action="store_true",
                   help="feed each prompt in one iteration (to measure the decode stall)")
    e.add_argument("--stall-ratio", type=float, default=DEFAULT_STALL_RATIO,
                   help="size prefill chunks so an iteration costs at most this many times a "
                   "decode-only one (chunks follow measured iteration times; 0: token budget only)")
    e.add_argument("--batch-invariant", action="store_true",
                   help="each session's rows in the shapes it would have alone: bit-identical "
                   "to serving it alone, slower")
    e.add_argument("--prompt-cache-mb", type=int, default=DEFAULT_PROMPT_CACHE_MB,
                   help="keep finished requests' KV (LRU, this many MB) so a prompt that starts "
                   "the same (the next turn of a chat) prefills only what is new; 0: off")
    add_key_args(p, open_help="talk to an unauthenticated fleet")
    p.set_defaults(func=run)


def fleet_engine(args, draft_tokens):
    """A RemoteEngine on the fleet's verifier agent, or None (no key, no live verifier); one
    line on stderr says which, and why (cli/where.py)."""
    from macfleet.cli import where as W
    from macfleet.cli.common import fleet_key_if_any
    from macfleet.engine.proposers.choice import AUTO, FLEET, resolve_proposer
    from macfleet.fleet.client import (NoFleet, choose_roles, drafting_for, fleet_id, members,
                                       probe)
    from macfleet.fleet.keys import KeyMissing, default_key_path
    from macfleet.serve.remote import RemoteEngine

    def say(where: W.Where) -> None:
        print(where.line("macfleet serve", "serving"), file=sys.stderr, flush=True)

    try:
        key = fleet_key_if_any(args)
    except KeyMissing:
        say(W.no_key(str(default_key_path())))
        return None
    fid = fleet_id(key)
    cards = members(key, wait_s=args.wait, expect=2)  # only cards whose tag checks
    try:
        verifier, proposers = choose_roles([probe(c, key, pings=1) for c in cards], args.model)
    except NoFleet as e:
        say(W.no_fleet(fid, args.wait, e.seen, str(e)))
        return None
    # draft-model agents when asked for `auto` or `draft` and the fleet has any; else `auto`
    # goes to the verifier agent as it is (it chooses among its own drafters block by block,
    # as `generate` through a fleet), or the drafter asked for on the other agents
    asked = AUTO if args.proposer == AUTO else resolve_proposer(args.proposer, args.model,
                                                                FLEET)[0]
    spec, proposers = drafting_for(asked, proposers,
                                   draft_agents=args.proposer in (AUTO, "draft"))
    say(W.in_fleet(fid, verifier.card, [p.card for p in proposers]))
    return RemoteEngine(verifier, proposers, key, proposer=spec,
                        draft_tokens=draft_tokens, max_active=args.batch_sessions,
                        max_queue=args.max_queue)


def local_proposer(args) -> str:
    """The in-process engine's drafter: --proposer; `auto` as in `generate`, chosen per block
    for each session (engine/choosing.py; the batch-invariant mode verifies chains of token
    drafts: n-gram lookup for it)."""
    from macfleet.engine.proposers.choice import AUTO, FALLBACK, resolve_proposer

    if args.proposer == AUTO:
        return FALLBACK if args.batch_invariant else AUTO
    return resolve_proposer(args.proposer, args.model)[0]


def _api_keys(args) -> tuple[str, ...]:
    """The API keys (none: no key needed): --api-key (repeated), the lines of --api-key-file,
    else $MACFLEET_API_KEY."""
    if args.api_key_file is not None:
        try:
            keys = [k.strip() for k in args.api_key_file.read_text().splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --api-key-file: {e}") from None
        keys = [k for k in keys if k]
        if not keys:
            raise UserError(f"{args.api_key_file} is empty")
    else:
        keys = list(args.api_key or ()) or [os.environ.get("MACFLEET_API_KEY") or ""]
        keys = [k for k in keys if k]
    if any(k != k.strip() or not k.isprintable() for k in keys):
        raise UserError("an API key must be printable, without spaces around it")
    return tuple(dict.fromkeys(keys))  # a repeated key is one key


def _validate(args) -> None:
    for name in ("token_budget", "batch_sessions", "max_queue", "max_tokens_cap",
                 "max_prompt_tokens", "max_body_bytes", "max_sessions_per_client"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_cache_mb < 0:
        raise UserError("--prompt-cache-mb must be >= 0")
    if not 0 <= args.stall_ratio <= 100:
        raise UserError("--stall-ratio must be 0..100")
    if not 0 <= args.port <= 65535:
        raise UserError("--port must be 0..65535")


def fleet_serve_args(up_args):
    """`macfleet up --serve`: serve's arguments for the fleet being started (its model, key)
    with the front options `up` was given (`add_front_options`), checked before any agent
    starts."""
    import argparse

    from macfleet.cli.parser import Parser

    sub = Parser(prog="macfleet").add_subparsers()
    add_parser(sub)
    args = sub.choices["serve"].parse_args([])
    shared = add_front_options(argparse.ArgumentParser(), batch_sessions=False) + (
        "model", "key", "open")
    for name in shared:
        setattr(args, name, getattr(up_args, name))
    if (getattr(up_args, "batch_sessions", None) or 0) > 0:  # up's verifier batch: the same
        args.batch_sessions = up_args.batch_sessions
    _validate(args)
    _api_keys(args)
    _template(args)
    return args


def _template(args) -> str | None:
    if args.chat_template is None:
        return None
    try:
        return args.chat_template.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --chat-template: {e}") from None


def run(args) -> int:
    _validate(args)
    from macfleet.engine.models import ModelSpecError, check_spec

    try:
        check_spec(args.model)
    except ModelSpecError as e:
        raise UserError(f"--model: {e}") from None
    keys = _api_keys(args)
    template = _template(args)
    k = parse_draft_tokens(args.draft_tokens)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(SOCKET_BACKLOG)  # before the banner: a client that reads it and connects
        # at once waits in the backlog for uvicorn instead of being refused
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    import uvicorn

    from macfleet.cli.common import ensure_model, load_model
    from macfleet.engine.models import ModelSpecError, load_tokenizer
    from macfleet.engine.proposers import ProposerSpecError
    from macfleet.serve.app import ServerConfig, create_app
    from macfleet.serve.engine import BatchEngine
    from macfleet.serve.schemas import Limits

    engine = None if args.local else fleet_engine(args, k)
    try:
        if engine is None:  # in-process: the weights and the tokenizer
            lm = load_model(args.model)
            tokenizer = lm.tokenizer
            engine = BatchEngine(
                lm, proposer=local_proposer(args), draft_tokens=k,
                token_budget=args.token_budget, max_active=args.batch_sessions,
                max_queue=args.max_queue, chunked=not args.no_chunked_prefill,
                invariant=args.batch_invariant, stall_ratio=args.stall_ratio,
                prompt_cache_bytes=args.prompt_cache_mb << 20)
        else:  # a fleet's verifier agent holds the weights: the front needs the tokenizer
            ensure_model(args.model)
            tokenizer = load_tokenizer(args.model)
    except (ModelSpecError, ProposerSpecError, ValueError) as e:
        raise UserError(str(e)) from None
    limits = Limits(args.max_body_bytes, args.max_prompt_tokens, args.max_tokens_cap,
                    args.max_sessions_per_client)
    app = create_app(engine.start(), tokenizer, ServerConfig(args.model, keys, limits,
                                                                 template))
    host, port = sock.getsockname()[:2]
    where = (f"in-process, budget {args.token_budget} tokens/iteration"
             if isinstance(engine, BatchEngine) else
             f"verifier agent {engine.verifier.card.name}, which batches the sessions")
    print(f"macfleet serve: {args.model} on http://{host}:{port}/v1 ({where}, "
          f"proposer {engine.proposer_spec}"
          f"{', batch-invariant' if args.batch_invariant else ''}"
          f"{', API key required' if len(keys) == 1 else ''}"
          f"{f', {len(keys)} API keys, a prompt cache each' if len(keys) > 1 else ''})",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    code = 0
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        code = 130
    finally:
        engine.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    # MLX can abort at interpreter exit after two threads ran compiled functions
    # (ml-explore/mlx#3126); everything is shut down and flushed, so leave without it.
    os._exit(code)
