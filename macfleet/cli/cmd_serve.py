"""`macfleet serve`: an OpenAI-compatible HTTP API, continuous batching of speculative blocks."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from macfleet.cli.common import UserError, add_key_args, parse_draft_tokens
from macfleet.serve.scheduler import DEFAULT_STALL_RATIO

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
SOCKET_BACKLOG = 2048  # uvicorn's default
DEFAULT_PROMPT_CACHE_MB = 512  # finished requests' KV kept for later prompts (serve/prompt_cache.py)


def add_front_options(p, *, wait_s: float = 2.0) -> tuple[str, ...]:
    """The options of the HTTP front and of its sessions on a fleet: one builder for `serve`
    and `up --serve` (which takes every one of them). Returns their `dest`s."""
    acts = [p.add_argument("--host", default="127.0.0.1"),
            p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")]
    key = p.add_mutually_exclusive_group()
    acts += [key.add_argument("--api-key", default=None,
                              help="require 'Authorization: Bearer KEY'"),
             key.add_argument("--api-key-file", type=Path, default=None),
             p.add_argument("--proposer", default="ngram",
                            help="per-session drafts: ngram[:N] | retrieval | layerskip:K | "
                            "draft:MODEL | none, or several joined by '+' (a token tree per "
                            "block, verified in the batch like the chains)"),
             p.add_argument("--draft-tokens", default="auto", help="K or auto (default: auto)"),
             p.add_argument("--max-active", type=int, default=16, help="sessions batched at once"),
             p.add_argument("--max-queue", type=int, default=64,
                            help="sessions waiting for a slot"),
             p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                            help="a Jinja chat template replacing the model's own (e.g. one with "
                            "tool support: tools are rendered by it and its tool-call format is "
                            "parsed)"),
             p.add_argument("--max-tokens-cap", type=int, default=1024),
             p.add_argument("--max-prompt-tokens", type=int, default=4096),
             p.add_argument("--max-body-bytes", type=int, default=1 << 20),
             p.add_argument("--max-sessions-per-client", type=int, default=16,
                            help="open sessions per client address"),
             p.add_argument("--wait", type=float, default=wait_s,
                            help="seconds to look for agents")]
    return tuple(a.dest for a in acts)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API (continuous batching)")
    p.add_argument("--local", action="store_true",
                   help="in-process verifier with continuous batching (default when no fleet "
                   "is found); without it a fleet's verifier agent serves each request")
    p.add_argument("--model", default="smollm2")
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
    """A RemoteEngine on the fleet's verifier agent, or None (no key, no live verifier)."""
    from macfleet.fleet.client import NoFleet, choose_roles, discover, fleet_id, probe
    from macfleet.fleet.keys import KeyMissing, resolve_key
    from macfleet.serve.remote import RemoteEngine

    try:
        key = resolve_key(args.key, open_fleet=args.open)
    except KeyMissing:
        return None
    cards = discover(fleet_id(key), wait_s=args.wait, expect=2)
    try:
        verifier, proposers = choose_roles([probe(c, key, pings=1) for c in cards], args.model)
    except NoFleet as e:
        if cards:
            print(f"macfleet serve: {e}; serving in-process", file=sys.stderr)
        return None
    return RemoteEngine(verifier, proposers, key, proposer=args.proposer,
                        draft_tokens=draft_tokens, max_active=args.max_active,
                        max_queue=args.max_queue)


def _api_key(args) -> str | None:
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text().strip()
        except OSError as e:
            raise UserError(f"cannot read --api-key-file: {e}") from None
        if not key:
            raise UserError(f"{args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("MACFLEET_API_KEY") or None


def _validate(args) -> None:
    for name in ("token_budget", "max_active", "max_queue", "max_tokens_cap",
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

    sub = argparse.ArgumentParser(prog="macfleet").add_subparsers()
    add_parser(sub)
    args = sub.choices["serve"].parse_args([])
    shared = add_front_options(argparse.ArgumentParser()) + ("model", "key", "open")
    for name in shared:
        setattr(args, name, getattr(up_args, name))
    _validate(args)
    _api_key(args)
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
    key = _api_key(args)
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

    from macfleet.engine.batch import BatchUnsupported
    from macfleet.cli.common import load_model
    from macfleet.engine.models import ModelSpecError
    from macfleet.engine.proposers import ProposerSpecError
    from macfleet.serve.app import ServerConfig, create_app
    from macfleet.serve.engine import BatchEngine
    from macfleet.serve.schemas import Limits

    engine = None if args.local else fleet_engine(args, k)
    try:
        lm = load_model(args.model)  # the tokenizer; the weights too when in-process
        engine = engine or BatchEngine(
            lm, proposer=args.proposer, draft_tokens=k, token_budget=args.token_budget,
            max_active=args.max_active, max_queue=args.max_queue,
            chunked=not args.no_chunked_prefill, invariant=args.batch_invariant,
            stall_ratio=args.stall_ratio, prompt_cache_bytes=args.prompt_cache_mb << 20)
    except (ModelSpecError, ProposerSpecError, BatchUnsupported, ValueError) as e:
        raise UserError(str(e)) from None
    limits = Limits(args.max_body_bytes, args.max_prompt_tokens, args.max_tokens_cap,
                    args.max_sessions_per_client)
    app = create_app(engine.start(), lm.tokenizer, ServerConfig(args.model, key, limits,
                                                                    template))
    host, port = sock.getsockname()[:2]
    where = (f"in-process, budget {args.token_budget} tokens/iteration"
             if isinstance(engine, BatchEngine) else
             f"verifier agent {engine.verifier.card.name}, which batches the sessions")
    print(f"macfleet serve: {args.model} on http://{host}:{port}/v1 ({where}, "
          f"proposer {args.proposer}"
          f"{', batch-invariant' if args.batch_invariant else ''}"
          f"{', API key required' if key else ''})", flush=True)
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
