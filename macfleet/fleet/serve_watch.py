"""Watching a `macfleet serve` from the dashboard (`macfleet dash --serve URL`).

`fetch_batch` reads ``GET /v1/macfleet/batch`` within a deadline and always returns a
`ServeView`: the server's `BatchView`, or why there is none (refused, timed out, 401, not a
macfleet server), so a server that is down shows as down and never stops the dashboard.
`ServeWatchSource` adds that view to each fleet snapshot (or to an empty one when no fleet is
observed). Decisions (`batch_url`, `decode_batch`) are pure; the HTTP is a thin stdlib shell
(http.client: a GET of a small JSON body needs no extra dependency).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from urllib.parse import urlsplit

from macfleet.fleet.batch import BATCH_PATH, BatchView, ServeView
from macfleet.fleet.snapshot import FleetSnapshot, SnapshotSource

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 1.0  # the whole request: connect, send, status, body
MAX_BODY_BYTES = 1 << 20
READ_CHUNK = 1 << 16

Fetch = Callable[..., ServeView]


def batch_url(url: str) -> str:
    """The batch route of a server written as a user would: ``host:port``,
    ``http://host:port`` or the OpenAI base URL ``http://host:port/v1``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) server address: {url!r}")
    path = parts.path.rstrip("/")
    path = path.removesuffix(BATCH_PATH).removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}{BATCH_PATH}"


def decode_batch(url: str, status: int, body: bytes) -> ServeView:
    """What one answer of the batch route means for the dashboard."""
    if status == 401:
        return ServeView(url, error="HTTP 401: missing or wrong API key (dash --api-key)")
    if status == 404:
        return ServeView(url, error="HTTP 404: no batch route here (not a macfleet server?)")
    if status != 200:
        return ServeView(url, error=f"HTTP {status}")
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        return ServeView(url, batch=BatchView.from_dict(data))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return ServeView(url, error=f"not a batch: {type(e).__name__}: {e}"[:200])


def fetch_batch(url: str, *, api_key: str | None = None,
                timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                clock: Callable[[], float] = time.monotonic) -> ServeView:
    """GET the batch of the server at ``url`` (any form `batch_url` takes) within ``timeout_s``."""
    target = batch_url(url)
    parts = urlsplit(target)
    deadline = clock() + timeout_s
    conn_cls = HTTPSConnection if parts.scheme == "https" else HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("GET", parts.path, headers=headers)
        conn.sock.settimeout(max(1e-3, deadline - clock()))
        resp = conn.getresponse()
        body = bytearray()
        while len(body) <= MAX_BODY_BYTES:
            left = deadline - clock()
            if left <= 0:
                raise TimeoutError("timed out")
            conn.sock.settimeout(left)  # each read gets only the time left, not a fresh timeout
            chunk = resp.read1(READ_CHUNK)
            if not chunk:
                break
            body += chunk
        else:
            return ServeView(url, error=f"answer over {MAX_BODY_BYTES} bytes")
        return decode_batch(url, resp.status, bytes(body))
    except TimeoutError:
        return ServeView(url, error=f"no answer within {timeout_s:g} s")
    except ConnectionRefusedError:
        return ServeView(url, error="connection refused (server not running?)")
    except (OSError, HTTPException) as e:
        return ServeView(url, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        conn.close()


class ServeWatchSource(SnapshotSource):
    """Snapshots with the watched server's `ServeView`, one fetch per poll.

    With an ``inner`` fleet source, its newest snapshot carries the view (half of each poll
    waits for the fleet, the rest at most `DEFAULT_FETCH_TIMEOUT_S` for the server); without
    one, an empty fleet does."""

    def __init__(self, url: str, inner: SnapshotSource | None = None, *,
                 api_key: str | None = None, fetch: Fetch = fetch_batch,
                 clock: Callable[[], float] = time.time) -> None:
        batch_url(url)  # a malformed address fails here, in the CLI, not in the worker
        self.url, self.inner, self.api_key = url, inner, api_key
        self._fetch, self._clock = fetch, clock
        self._fleet: FleetSnapshot | None = None
        self._closed = threading.Event()

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        if self._closed.is_set():
            return None
        if self.inner is not None:
            snap = self.inner.poll(timeout_s / 2)
            self._fleet = snap or self._fleet
        if self._closed.is_set():
            return None
        view = self._fetch(self.url, api_key=self.api_key,
                           timeout_s=min(DEFAULT_FETCH_TIMEOUT_S, max(0.05, timeout_s)))
        if view.batch is None:
            log.debug("server %s: %s", self.url, view.error)
        base = self._fleet or FleetSnapshot.empty(taken_at=self._clock())
        return replace(base, serve=view)

    def close(self) -> None:
        self._closed.set()
        if self.inner is not None:
            self.inner.close()
