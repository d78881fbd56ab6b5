"""Before a request is admitted: its body decoded without holding the event loop (on a worker
thread: serve/app.py), and its API key turned into its prompt-cache partition."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from macfleet.serve.schemas import RequestError


def partition(api_keys: Sequence[str], key: str) -> str:
    """The prompt-cache partition of a request that carried `key`: "" for a server of one key
    or none, else a hash of the key, so one key's prompts never show in another's answers."""
    if len(api_keys) <= 1:
        return ""
    return hashlib.sha256(b"macfleet-cache-partition\0" + key.encode()).hexdigest()[:16]


def _dict(pairs: list[tuple[str, object]]) -> dict:
    return dict(pairs)


def decode_body(buf: bytes) -> object:
    """The body's JSON; a 400 when it is not JSON or nested too deeply. The Python object hook
    makes the decoder hand the GIL (and so the event loop) over every few milliseconds; the C
    decoder alone would hold it for a whole body."""
    try:
        return json.loads(buf, object_pairs_hook=_dict)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] deeper than the parser's stack
        raise RequestError("the body's JSON is nested too deeply") from None
