"""Wire protocol of the KV link: typed msgpack headers followed by raw payload frames.

A message is one ZeroMQ multipart message:

    [header, *payload_frames]
    header          msgpack map {"type": str, "version": int, <the fields of that message type>}
    payload_frames  raw bytes (a KV tensor viewed as uint8), never packed into msgpack

Each message type below is a frozen dataclass: its annotations are the schema and `bounded(...)`
holds the limits. Building a message validates it (so a bad message fails where it is made), and
`decode` refuses an oversized header before unpacking it, a bad field before building the message,
and a wrong frame count or length before any tensor is made.

To add a message type: subclass `Message` with `type_name=` (and `max_frames=` if it carries
payload), declare its fields, and override `check()` for rules that span fields and
`frame_sizes()` for the byte length of each payload frame the header promises.

A KVLayer payload has the layout of `kernels.reference.kv_pack`:
    [layer_end - layer_start, 2, num_tokens, num_kv_heads, head_dim]   (K then V), engine KV dtype.

torch is imported only by the tensor helpers, so a process that only speaks the protocol (the
router) does not load it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import xxhash

from kvtransfer.errors import ChecksumMismatchError, ProtocolError

PROTOCOL_VERSION = 1

# ---- bounds: checked before anything sized by the peer is allocated ----
MAX_HEADER_BYTES = 1 << 20  # control messages with long prompts will share this header format
MAX_ID_LEN = 256  # request and engine ids
MAX_STR_LEN = 4096  # reasons, messages and any other string
MAX_DICT_ITEMS = 64
MAX_SHAPE_DIMS = 8
MAX_LAYERS = 1024
MAX_TOKENS = 1 << 24
MAX_LOGPROBS = 21  # top-20 plus the sampled token
MAX_FRAME_BYTES = 1 << 31  # one payload frame; transport.py also sets it as ZMQ_MAXMSGSIZE
MAX_CHECKSUM = (1 << 64) - 1  # payload_checksum is 64-bit
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1

# KV dtypes by torch attribute name, with their size in bytes.
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
ROLES = ("prefill", "decode")


def bounded(*, default: Any = dataclasses.MISSING, **limits: Any) -> Any:
    """A message field with limits: max_len (str, bytes, list, dict), min / max (ints, also the
    ints inside a list or dict), choices (str)."""
    return field(default=default, metadata=limits)


# ---- checksums ----

def payload_checksum(buffer: Any) -> int:
    """64-bit XXH3 of one payload frame's bytes (python-xxhash), in one pass at memory speed.

    Catches corrupted, truncated, stale or misplaced bytes; it is not an authenticator (CURVE's MAC
    is). Why XXH3 and not zlib.crc32: on the 2-core benchmark box XXH3 hashed 1 MiB in ~17 us (cache
    hot) and 64 MiB at ~28 GiB/s, crc32 at ~4 GB/s, about the CPU cost of moving the bytes over
    loopback (bench/connector_throughput.py prints both)."""
    return xxhash.xxh3_64_intdigest(memoryview(buffer).cast("B"))


def combine_checksums(checksums: Iterable[int]) -> int:
    """One checksum over a request's per-message checksums in send order (KVDone.checksum):
    a lost, repeated or reordered KVLayer changes it without reading the payload twice."""
    data = b"".join(int(c).to_bytes(8, "little") for c in checksums)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# ---- the generic field validator: one checker per field, compiled once per message type ----

Checker = Callable[[str, Any], Any]  # (path, value) -> the value, normalised; raises ProtocolError


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    return "None" if hint is type(None) else hint.__name__


def _kind_test(hint: Any) -> Callable[[Any], bool]:
    origin = typing.get_origin(hint)
    if origin is tuple:
        return lambda v: isinstance(v, (list, tuple))
    if origin is dict:
        return lambda v: isinstance(v, dict)
    if hint is int:  # bool is an int in Python, never on the wire
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return lambda v: isinstance(v, hint)


def _type_error(path: str, value: Any, type_name: str) -> ProtocolError:
    return ProtocolError(f"{path}: expected {type_name}, got {type(value).__name__} {_short(value)}")


def _typed(hint: Any, check: Checker) -> Checker:
    """Wrap a checker with the type test of its annotation."""
    is_kind, name = _kind_test(hint), _type_name(hint)

    def typed(path: str, value: Any) -> Any:
        if not is_kind(value):
            raise _type_error(path, value, name)
        return check(path, value)
    return typed


def _int_checker(limits: dict) -> Checker:
    low, high = limits.get("min", INT64_MIN), limits.get("max", UINT64_MAX)

    def check(path: str, value: Any) -> int:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise _type_error(path, value, "int")
        if not low <= value <= high:
            raise ProtocolError(f"{path}={value} is out of bounds: it must be in [{low}, {high}]")
        return value
    return check


def _sized_checker(hint: Any, limits: dict, default_max: int, unit: str) -> Checker:
    """str, bytes, list or dict of at most max_len items (and one of `choices`, if given)."""
    max_len, choices, name = limits.get("max_len", default_max), limits.get("choices"), _type_name(hint)
    kind = {tuple: (list, tuple)}.get(typing.get_origin(hint), typing.get_origin(hint) or hint)

    def check(path: str, value: Any) -> Any:
        if not isinstance(value, kind):
            raise _type_error(path, value, name)
        if len(value) > max_len:
            raise ProtocolError(f"{path} has {len(value)} {unit}, over the limit of {max_len}")
        if choices is not None and value not in choices:
            raise ProtocolError(f"{path}={_short(value)} is not one of {list(choices)}")
        return value
    return check


def _item_limits(limits: dict) -> dict:
    return {k: v for k, v in limits.items() if k in ("min", "max")}


def _list_checker(hint: Any, limits: dict) -> Checker:
    item_hint = typing.get_args(hint)[0]
    check_len = _sized_checker(hint, limits, MAX_STR_LEN, "items")
    check_item = _compile(item_hint, _item_limits(limits))
    low, high = limits.get("min", INT64_MIN), limits.get("max", UINT64_MAX)

    def check(path: str, value: Sequence) -> tuple:
        check_len(path, value)
        if item_hint is int and all(type(v) is int for v in value) and low <= min(value, default=low) \
                and max(value, default=high) <= high:
            return tuple(value)  # fast path for long token id lists
        return tuple([check_item(f"{path}[{i}]", item) for i, item in enumerate(value)])
    return check


def _dict_checker(hint: Any, limits: dict) -> Checker:
    key_hint, value_hint = typing.get_args(hint)
    check_len = _sized_checker(hint, limits, MAX_DICT_ITEMS, "entries")
    check_key, check_value = _compile(key_hint, _item_limits(limits)), _compile(value_hint, _item_limits(limits))

    def check(path: str, value: dict) -> dict:
        check_len(path, value)
        return {check_key(f"{path} key", k): check_value(f"{path}[{_short(k, 20)}]", v) for k, v in value.items()}
    return check


def _union_checker(hint: Any, limits: dict) -> Checker:
    arms = [(_kind_test(arm), _compile(arm, limits)) for arm in typing.get_args(hint)]
    name = _type_name(hint)

    def check(path: str, value: Any) -> Any:
        for is_kind, check_arm in arms:
            if is_kind(value):
                return check_arm(path, value)
        raise _type_error(path, value, name)
    return check


def _compile(hint: Any, limits: dict) -> Checker:
    """Checker for one annotation: int, float, bool, str, bytes, None, tuple[T, ...] (a list on the
    wire), dict[K, V], and unions of them (X | None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(hint, limits)
    if origin is tuple:
        return _list_checker(hint, limits)
    if origin is dict:
        return _dict_checker(hint, limits)
    if hint is int:
        return _int_checker(limits)
    if hint is float:
        return _typed(hint, lambda path, value: float(value))
    if hint is str:
        return _sized_checker(hint, limits, MAX_STR_LEN, "characters")
    if hint is bytes:
        return _sized_checker(hint, limits, MAX_STR_LEN, "bytes")
    if hint in (bool, type(None)):
        return _typed(hint, lambda path, value: value)
    raise TypeError(f"message fields cannot be {hint!r}: use int, float, bool, str, bytes, tuple[T, ...], dict or X | None")


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    path: str  # "kv_layer.shape", for error messages
    check: Checker
    required: bool


@functools.cache
def _field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        _FieldSpec(f.name, f"{cls.type_name}.{f.name}", _compile(hints[f.name], dict(f.metadata)),
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )


# ---- messages ----

MESSAGE_TYPES: dict[str, type[Message]] = {}


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message type; subclasses register themselves under `type_name`."""

    type_name: ClassVar[str] = ""
    max_frames: ClassVar[int] = 0

    def __init_subclass__(cls, *, type_name: str, max_frames: int = 0, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type_name in MESSAGE_TYPES:
            raise TypeError(f"message type {type_name!r} is already defined by {MESSAGE_TYPES[type_name].__name__}")
        cls.type_name, cls.max_frames = type_name, max_frames
        MESSAGE_TYPES[type_name] = cls

    def __post_init__(self) -> None:
        for spec in _field_specs(type(self)):
            value = getattr(self, spec.name)
            checked = spec.check(spec.path, value)
            if checked is not value:
                object.__setattr__(self, spec.name, checked)
        self.check()

    def check(self) -> None:
        """Rules that span several fields; raise ProtocolError naming them."""

    def frame_sizes(self) -> tuple[int, ...]:
        """Byte length of each payload frame this header promises (none for control messages)."""
        return ()

    def verify_frames(self, frames: Sequence[memoryview], *, verify_checksum: bool) -> None:
        sizes = self.frame_sizes()
        if len(frames) != len(sizes):
            raise ProtocolError(f"{self.type_name} promises {len(sizes)} payload frame(s) but {len(frames)} came")
        for index, (frame, size) in enumerate(zip(frames, sizes)):
            if frame.nbytes != size:
                raise ProtocolError(f"{self.type_name} frame {index} has {frame.nbytes} bytes, the header promises {size}")

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"type": self.type_name, "version": PROTOCOL_VERSION}
        for spec in _field_specs(type(self)):
            header[spec.name] = getattr(self, spec.name)
        return header

    @classmethod
    def from_header(cls, header: dict) -> Message:
        specs = _field_specs(cls)
        names = {spec.name for spec in specs}
        unknown = [key for key in header if key not in names and key not in ("type", "version")]
        if unknown:
            raise ProtocolError(f"{cls.type_name}: unexpected field(s) {_short(unknown)}; expected {sorted(names)}")
        missing = [spec.name for spec in specs if spec.required and spec.name not in header]
        if missing:
            raise ProtocolError(f"{cls.type_name}: missing field(s) {missing}")
        return cls(**{name: header[name] for name in names if name in header})


@dataclass(frozen=True, kw_only=True)
class Hello(Message, type_name="hello"):
    """Client -> server, first on a link: who I am and the KV layout I hold (LayoutFingerprint)."""

    fingerprint: dict[str, str | int] = bounded(max_len=MAX_DICT_ITEMS)
    role: str = bounded(choices=ROLES)
    engine_id: str = bounded(max_len=MAX_ID_LEN)


@dataclass(frozen=True, kw_only=True)
class HelloAck(Message, type_name="hello_ack"):
    """Server -> client: the link is accepted, or refused with the reason (e.g. layout differences)."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class KVWant(Message, type_name="kv_want"):
    """D -> P: send the KV of prompt tokens [skip_tokens, skip_tokens + num_tokens) of a request.

    skip_tokens is D's own prefix-cache hit (block aligned); skip_tokens + num_tokens is the prompt
    length, which P checks against the prompt it was given."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    skip_tokens: int = bounded(min=0, max=MAX_TOKENS)
    num_tokens: int = bounded(min=1, max=MAX_TOKENS)


@dataclass(frozen=True, kw_only=True)
class KVLayer(Message, type_name="kv_layer", max_frames=1):
    """P -> D: KV of layers [layer_start, layer_end) for tokens [token_start, token_start + num_tokens),
    in one payload frame of `nbytes` bytes shaped `shape` in `dtype`, with its payload_checksum.

    token_start lets chunked prefill send one layer range in several token chunks."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    layer_start: int = bounded(min=0, max=MAX_LAYERS - 1)
    layer_end: int = bounded(min=1, max=MAX_LAYERS)
    token_start: int = bounded(min=0, max=MAX_TOKENS)
    num_tokens: int = bounded(min=1, max=MAX_TOKENS)
    dtype: str = bounded(choices=tuple(DTYPE_SIZES))
    shape: tuple[int, ...] = bounded(max_len=MAX_SHAPE_DIMS, min=1, max=MAX_FRAME_BYTES)
    nbytes: int = bounded(min=1, max=MAX_FRAME_BYTES)
    checksum: int = bounded(min=0, max=MAX_CHECKSUM)

    def check(self) -> None:
        num_layers = self.layer_end - self.layer_start
        if num_layers < 1:
            raise ProtocolError(f"kv_layer: layer_end={self.layer_end} must be greater than layer_start={self.layer_start}")
        if len(self.shape) != 5 or self.shape[:3] != (num_layers, 2, self.num_tokens):
            raise ProtocolError(
                f"kv_layer.shape={list(self.shape)} must be [num_layers={num_layers}, 2, "
                f"num_tokens={self.num_tokens}, num_kv_heads, head_dim]")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.nbytes != expected:
            raise ProtocolError(f"kv_layer.nbytes={self.nbytes} but shape {list(self.shape)} of {self.dtype} is {expected} bytes")

    def frame_sizes(self) -> tuple[int, ...]:
        return (self.nbytes,)

    def verify_frames(self, frames: Sequence[memoryview], *, verify_checksum: bool) -> None:
        super().verify_frames(frames, verify_checksum=verify_checksum)
        if verify_checksum and payload_checksum(frames[0]) != self.checksum:
            raise ChecksumMismatchError(
                f"kv_layer payload of request {self.request_id!r} (layers {self.layer_start}..{self.layer_end}) "
                f"fails its checksum: the bytes were corrupted in flight or by the sender; abort and retry the request",
                request_id=self.request_id)

    def tensor(self, frame: Any) -> Any:
        """Zero-copy view of the payload frame: [num_layers, 2, num_tokens, num_kv_heads, head_dim]."""
        return tensor_from_frame(frame, self.dtype, self.shape)

    @classmethod
    def from_tensor(cls, kv: Any, *, request_id: str, layer_start: int, token_start: int) -> tuple[KVLayer, memoryview]:
        """Header and payload for kv [num_layers, 2, num_tokens, num_kv_heads, head_dim] on the CPU."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv has shape {list(kv.shape)}: expected [num_layers, 2, num_tokens, num_kv_heads, head_dim]")
        payload = as_buffer(kv)
        msg = cls(request_id=request_id, layer_start=layer_start, layer_end=layer_start + kv.shape[0],
                  token_start=token_start, num_tokens=kv.shape[2], dtype=dtype_name(kv.dtype),
                  shape=tuple(kv.shape), nbytes=payload.nbytes, checksum=payload_checksum(payload))
        return msg, payload


@dataclass(frozen=True, kw_only=True)
class KVDone(Message, type_name="kv_done"):
    """P -> D: every KVLayer of the request is sent. checksum = combine_checksums(KVLayer checksums
    in send order); first_logprobs ({token_id: logprob}) only when the request asked for logprobs."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    first_token: int = bounded(min=0, max=(1 << 31) - 1)
    num_tokens: int = bounded(min=1, max=MAX_TOKENS)
    checksum: int = bounded(min=0, max=MAX_CHECKSUM)
    first_logprobs: dict[int, float] | None = bounded(default=None, max_len=MAX_LOGPROBS, min=0, max=(1 << 31) - 1)


@dataclass(frozen=True, kw_only=True)
class KVAck(Message, type_name="kv_ack"):
    """D -> P: the request's KV arrived intact (ok) or not (reason); P may free its blocks either way."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    ok: bool
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Abort(Message, type_name="abort"):
    """Either way: stop work on a request and free what it holds."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Error(Message, type_name="error"):
    """Either way: the peer's last message could not be served; code is an error class's `code`."""

    code: str = bounded(max_len=64)
    message: str
    request_id: str | None = bounded(default=None, max_len=MAX_ID_LEN)

    @classmethod
    def from_exception(cls, exc: BaseException) -> Error:
        request_id = getattr(exc, "request_id", None)
        return cls(code=str(getattr(exc, "code", "internal_error"))[:64], message=str(exc)[:MAX_STR_LEN],
                   request_id=request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_LEN else None)


# ---- encode / decode ----

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
        detail = f"{type(exc).__name__}: {_short(str(exc))}" if str(exc) else type(exc).__name__
        raise ProtocolError(f"header is not valid msgpack ({detail}): the peer does not speak this protocol") from exc


def _message_class(header: Any) -> type[Message]:
    if not isinstance(header, dict):
        kind = "array" if isinstance(header, tuple) else type(header).__name__
        raise ProtocolError(f"header is a msgpack {kind}, expected a map with 'type' and 'version'")
    version = header.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {_short(version)} (this engine speaks version "
                            f"{PROTOCOL_VERSION}): run the same pdserve release on both ends of the link")
    type_name = header.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(type_name)}: expected one of {sorted(MESSAGE_TYPES)}")
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


# ---- buffers and tensors (torch imported lazily) ----

def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"KV dtype {dtype} cannot be sent: use one of {sorted(DTYPE_SIZES)}")
    return name


def as_buffer(obj: Any) -> memoryview:
    """A flat byte view of a CPU tensor (any dtype, bf16 included), bytes, bytearray, memoryview or
    numpy array, without copying (a non-contiguous tensor is made contiguous first)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"tensor is on {obj.device}: copy it to (pinned) CPU memory before sending")
        return memoryview(obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # [nbytes]
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot send a {type(obj).__name__} as a frame: pass a CPU torch.Tensor, bytes, "
                        f"bytearray, memoryview or numpy array") from None
    if not view.c_contiguous:
        raise ValueError("cannot send a non-contiguous buffer as a frame: make it contiguous first")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tensor_from_frame(frame: Any, dtype: str, shape: Sequence[int]) -> Any:
    """A tensor viewing the frame's memory (no copy). Treat it as read-only, since it aliases the
    received frame: copy out of it (into KV blocks), never write into it."""
    import torch

    if dtype not in DTYPE_SIZES:
        raise ProtocolError(f"dtype {dtype!r} is not a KV dtype: expected one of {sorted(DTYPE_SIZES)}")
    if memoryview(frame).readonly:  # bytes; zmq frames are writable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
            flat = torch.frombuffer(frame, dtype=torch.uint8)  # [nbytes]
    else:
        flat = torch.frombuffer(frame, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).view(tuple(shape))
