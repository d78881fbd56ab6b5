"""The bridge's exceptions.

One `ProtocolError` with a short string `code` covers everything a peer can get wrong (it travels
back as an `ErrorReply` with the same code, so both ends speak the same vocabulary). Client-side
waits raise `TransportTimeout` or `PeerUnavailable` instead, because those are about *our* link,
not about what a peer said.
"""

from __future__ import annotations

UNKNOWN_TYPE = "unknown_type"
BAD_VERSION = "bad_version"
MALFORMED = "malformed"
BAD_SHAPE = "bad_shape"
BAD_DTYPE = "bad_dtype"
OVERSIZE = "oversize"
AUTH = "auth"
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
BUSY = "busy"
INTERNAL = "internal"
TIMEOUT = "timeout"
UNAVAILABLE = "unavailable"
FORBIDDEN = "forbidden"  # a request named something this agent may not reach (an endpoint)

CODES = frozenset(
    {
        UNKNOWN_TYPE,
        BAD_VERSION,
        MALFORMED,
        BAD_SHAPE,
        BAD_DTYPE,
        OVERSIZE,
        AUTH,
        BAD_REQUEST,
        NOT_FOUND,
        BUSY,
        INTERNAL,
        TIMEOUT,
        UNAVAILABLE,
        FORBIDDEN,
    }
)


class ProtocolError(Exception):
    """A message was refused, or a peer answered with an error.

    `code` is one of CODES (a newer peer may send one we do not know; it is kept as is).
    `msg_id` is the id of the offending message when its header could be read, so that a server
    can still address its error reply to the request.
    """

    UNKNOWN_TYPE = UNKNOWN_TYPE
    BAD_VERSION = BAD_VERSION
    MALFORMED = MALFORMED
    BAD_SHAPE = BAD_SHAPE
    BAD_DTYPE = BAD_DTYPE
    OVERSIZE = OVERSIZE
    AUTH = AUTH
    BAD_REQUEST = BAD_REQUEST
    NOT_FOUND = NOT_FOUND
    BUSY = BUSY
    INTERNAL = INTERNAL
    TIMEOUT = TIMEOUT
    UNAVAILABLE = UNAVAILABLE

    def __init__(self, code: str, message: str = "", *, msg_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.msg_id = msg_id


class TransportTimeout(TimeoutError):
    """A client wait passed its deadline (no reply, or no next message of a stream)."""


class PeerUnavailable(ConnectionError):
    """No connection to the peer could be used before the deadline (nothing was sent)."""
