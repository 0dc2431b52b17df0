"""Errors of the wire layer (codec and sockets) shared by every plane, and the refusal of a request
that engines and the router share; each has a short `code` that an Error reply can repeat."""

from __future__ import annotations


class WireError(Exception):
    """Base of every error raised while encoding, decoding, sending or receiving a message."""

    code = "wire_error"


class ProtocolError(WireError, ValueError):
    """A message that breaks the wire protocol: bad header, field, size, frame or checksum.

    The receiving loop answers it with an `Error` message and keeps serving. `request_id` is set
    when the bad message named one; `peer_id` is set by a ROUTER socket that knows the sender.
    """

    code = "protocol_error"

    def __init__(self, message: str, *, request_id: str | None = None, peer_id: bytes | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.peer_id = peer_id


class TransportError(WireError):
    """A socket that cannot be made, bound, connected or used as asked."""

    code = "transport_error"


class TransportTimeout(TransportError, TimeoutError):
    """A send that no peer accepted within its time bound."""

    code = "timeout"


class PeerUnreachableError(TransportError):
    """A ROUTER send addressed to a peer that is not (or no longer) connected."""

    code = "peer_unreachable"


class CurveUnavailableError(TransportError):
    """CURVE was asked for but the installed libzmq was built without it."""

    code = "curve_unavailable"


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message says what to change. Engines answer
    it with a TokenDelta whose error_code is "invalid_request" (the router's 400)."""

    code = "invalid_request"
    field: str | None = None  # the field at fault, when one is


class InvalidSamplingParams(InvalidRequestError, ProtocolError):
    """Sampling values out of range. A ProtocolError too, so that a header carrying them is refused
    while it is decoded, with the request id it named. `field` names the SamplingParams field at fault (the
    router's 400 names the request's parameter from it)."""

    def __init__(self, message: str, *, field: str | None = None, request_id: str | None = None,
                 peer_id: bytes | None = None):
        super().__init__(message, request_id=request_id, peer_id=peer_id)
        self.field = field
