"""Encode and decode one message: [msgpack header, *raw payload frames], validated and bounded
before anything sized by the peer is built (layout: docs/design/wire-protocol.md)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import msgpack

from pdserve.control.errors import ProtocolError
from pdserve.control.schema import MAX_HEADER_BYTES, MAX_ID_LEN, MESSAGE_TYPES, PROTOCOL_VERSION, Message, short_repr


def as_buffer(obj: Any) -> memoryview:
    """A flat byte view of a CPU tensor (any dtype, bf16 included), bytes, bytearray, memoryview or
    numpy array, without copying (a non-contiguous tensor is made contiguous first)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_bytes(obj, torch)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot send a {type(obj).__name__} as a frame: pass a CPU torch.Tensor, bytes, "
                        f"bytearray, memoryview or numpy array") from None
    if not view.c_contiguous:
        raise ValueError("cannot send a non-contiguous buffer as a frame: make it contiguous first")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _tensor_bytes(tensor: Any, torch: Any) -> memoryview:
    """[nbytes] view of a CPU tensor in as few torch calls as possible: this runs once per KV message."""
    if not tensor.is_cpu:
        raise ValueError(f"tensor is on {tensor.device}: copy it to (pinned) CPU memory before sending")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dim() == 0 or not tensor.is_contiguous():
        tensor = tensor.reshape(-1).contiguous()
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


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
