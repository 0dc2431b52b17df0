"""Wire protocol of the KV link and the control plane: encode and decode of typed msgpack headers
followed by raw payload frames.

A message is one ZeroMQ multipart message:

    [header, *payload_frames]
    header          msgpack map {"type": str, "version": int, <the fields of that message type>}
    payload_frames  raw bytes (a KV tensor viewed as uint8), never packed into msgpack

`decode` refuses an oversized header before unpacking it, a bad field before building the message,
and a wrong frame count or length before any tensor is made.

The protocol is split by responsibility; this module re-exports what callers import from it:
    kvtransfer.schema    Message base (pydantic), registry, bounds, header <-> message, errors
    kvtransfer.messages  the KV link's messages (Hello ... KVLayer ... Error)
    kvtransfer.payload   payload buffers, tensor views of frames, checksums
    kvtransfer.control   the router <-> engine messages
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from pdserve.kvtransfer.errors import ProtocolError
from pdserve.kvtransfer.messages import (
    ROLES, Abort, Error, FrameDim, Hello, HelloAck, KVAck, KVDone, KVLayer, KVWant, Role, TokenId,
)
from pdserve.kvtransfer.payload import (
    DTYPE_SIZES, KVDtype, as_buffer, combine_checksums, dtype_name, payload_checksum, tensor_from_frame,
)
from pdserve.kvtransfer.schema import (
    INT64_MIN, MAX_CHECKSUM, MAX_DICT_ITEMS, MAX_FRAME_BYTES, MAX_HEADER_BYTES, MAX_ID_LEN, MAX_LAYERS,
    MAX_LOGPROBS, MAX_SHAPE_DIMS, MAX_STR_LEN, MAX_TOKENS, MESSAGE_TYPES, PROTOCOL_VERSION, UINT64_MAX,
    Message, WireInt, WireModel, bounded, max_items, short_repr,
)

# The names of the single-module protocol, and the new field types: imports from here keep working.
__all__ = [
    "DTYPE_SIZES", "INT64_MIN", "MAX_CHECKSUM", "MAX_DICT_ITEMS", "MAX_FRAME_BYTES", "MAX_HEADER_BYTES",
    "MAX_ID_LEN", "MAX_LAYERS", "MAX_LOGPROBS", "MAX_SHAPE_DIMS", "MAX_STR_LEN", "MAX_TOKENS",
    "MESSAGE_TYPES", "PROTOCOL_VERSION", "ROLES", "UINT64_MAX",
    "Abort", "Error", "FrameDim", "Hello", "HelloAck", "KVAck", "KVDone", "KVDtype", "KVLayer", "KVWant",
    "Message", "Role", "TokenId", "WireInt", "WireModel",
    "as_buffer", "bounded", "combine_checksums", "decode", "dtype_name", "encode", "max_items",
    "payload_checksum", "tensor_from_frame",
]


def encode(msg: Message, *buffers: Any) -> list[bytes | memoryview]:
    """[header, *payload frames] for `socket.send_multipart(parts, copy=False)`. Buffers (CPU
    tensors, bytes, numpy arrays) are not copied: keep them unchanged until they are sent."""
    views = [as_buffer(buffer) for buffer in buffers]
    msg.verify_frames(views, verify_checksum=False)  # the count and length of each frame
    header = msgpack.packb(msg.to_header(), use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.type_name} header is {len(header)} bytes, over the limit of {MAX_HEADER_BYTES}")
    return [header, *views]


def _unpack_header(part: Any) -> Any:
    view = memoryview(part)
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {view.nbytes} bytes, over the limit of {MAX_HEADER_BYTES}: "
                            f"payload belongs in raw frames after the header")
    try:
        return msgpack.unpackb(view, raw=False, use_list=False, strict_map_key=False,
                               max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                               max_array_len=MAX_HEADER_BYTES, max_map_len=MAX_HEADER_BYTES, max_ext_len=0)
    except Exception as exc:  # untrusted bytes: every msgpack failure is the peer's protocol error
        detail = f"{type(exc).__name__}: {short_repr(str(exc))}" if str(exc) else type(exc).__name__
        raise ProtocolError(f"header is not valid msgpack ({detail}): the peer does not speak this protocol") from exc


def _message_class(header: Any) -> type[Message]:
    if not isinstance(header, dict):
        kind = "array" if isinstance(header, tuple) else type(header).__name__
        raise ProtocolError(f"header is a msgpack {kind}, expected a map with 'type' and 'version'")
    version = header.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {short_repr(version)} (this engine speaks version "
                            f"{PROTOCOL_VERSION}): run the same pdserve release on both ends of the link")
    type_name = header.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {short_repr(type_name)}: expected one of {sorted(MESSAGE_TYPES)}")
    return cls


def _request_id_of(header: dict) -> str | None:
    request_id = header.get("request_id")
    return request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_LEN else None


def decode(parts: Sequence[Any], *, verify_checksum: bool = True) -> tuple[Message, list[memoryview]]:
    """Validate [header, *frames] as received (bytes or zmq.Frame) -> (message, payload views).

    Raises ProtocolError naming the field and the problem; `request_id` is set when known."""
    if not parts:
        raise ProtocolError("empty message: expected a msgpack header frame")
    header = _unpack_header(parts[0])
    cls = _message_class(header)
    request_id = _request_id_of(header)
    if len(parts) - 1 > cls.max_frames:
        raise ProtocolError(f"{cls.type_name} carries at most {cls.max_frames} payload frame(s), got {len(parts) - 1}",
                            request_id=request_id)
    try:
        msg = cls.from_header(header)
        frames = [memoryview(part) for part in parts[1:]]
        msg.verify_frames(frames, verify_checksum=verify_checksum)
    except ProtocolError as exc:
        exc.request_id = exc.request_id or request_id
        raise
    return msg, frames
