"""Message schemas of the wire protocol: pydantic v2 models, strict, frozen, bounded, whose
validation errors become ProtocolError naming the field (rules: docs/design/wire-protocol.md)."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from pdserve.control.errors import ProtocolError

PROTOCOL_VERSION = 6  # 2: SamplingParams.include_stop_str_in_output; 3: prompt_logprobs, structured output, TokenDelta.stopped_by_constraint; 4: KVHold; 5: incarnations; 6: sliding layers send only their window, per-layer fingerprint

# ---- bounds: checked before anything sized by the peer is allocated ----
MAX_HEADER_BYTES = 1 << 20  # control messages with long prompts will share this header format
MAX_ID_LEN = 256  # request and engine ids
MAX_STR_LEN = 4096  # reasons, messages and any other string
MAX_DICT_ITEMS = 64
MAX_UNKNOWN_KEYS = 8  # of a peer's map, the ones an error names (the others are not even validated)
MAX_SHAPE_DIMS = 8
MAX_LAYERS = 1024
MAX_TOKENS = 1 << 24
MAX_LOGPROBS = 21  # top-20 plus the sampled token
MAX_FRAME_BYTES = 1 << 31  # one payload frame; control/sockets.py also sets it as ZMQ_MAXMSGSIZE
MAX_CHECKSUM = (1 << 64) - 1  # payload_checksum is 64-bit
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1

WireInt = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]  # any int msgpack can carry
MAX_TOKEN_ID = (1 << 31) - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Role = Literal["prefill", "decode", "dual"]  # dual: takes either role per request (pdserve engine)
ROLES: tuple[str, ...] = typing.get_args(Role)


def max_items(limit: int) -> BeforeValidator:
    """Annotated metadata of a tuple or dict field: at most `limit` items, counted before any item
    is validated (pydantic counts a dict's entries only after validating them all); a list (from a
    caller; msgpack gives tuples) is stored as a tuple."""

    def check(value: Any) -> Any:
        if isinstance(value, (list, tuple, dict)) and len(value) > limit:
            raise PydanticCustomError("too_long", "over the limit of {max_length}", {"max_length": limit})
        return tuple(value) if type(value) is list else value
    return BeforeValidator(check)


# ---- ValidationError -> ProtocolError ----

_EXPECTED = {"int_type": "int", "float_type": "float", "string_type": "str", "bool_type": "bool",
             "bytes_type": "bytes", "dict_type": "dict", "tuple_type": "list", "none_required": "None",
             "model_type": "dict"}
_UNITS = {"string_too_long": "characters", "bytes_too_long": "bytes"}


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _walk(cls: type[WireModel], loc: Sequence[int | str]) -> tuple[str, type[WireModel] | None]:
    """("first_logprobs", 42) -> "kv_done.first_logprobs[42]"; a nested model's field is ".name"
    ("generate.sampling_params.top_k"); a dict key's own error ends in "[key]". Also returns the
    model that the path ends in (None when it ends in anything else)."""
    path, model = cls.type_name, cls
    for index, part in enumerate(loc):
        if index == 0 or (model is not None and part in model.model_fields):
            field = model.model_fields.get(part) if model is not None else None
            path += f".{part}"
            model = _nested_model(field.annotation) if field is not None else None
        elif part != "[key]":
            model = None
            path += " key" if loc[index + 1:index + 2] == ("[key]",) else f"[{short_repr(part, 20)}]"
    return path, model


def _path(cls: type[WireModel], loc: Sequence[int | str]) -> str:
    return _walk(cls, loc)[0]


def _nested_model(annotation: Any) -> type[WireModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, WireModel) else None


def _describe(cls: type[WireModel], error: ErrorDetails) -> str:
    kind, value, ctx, loc = error["type"], error["input"], error.get("ctx", {}), error["loc"]
    path = _path(cls, loc)
    if kind in _EXPECTED:
        parent = _walk(cls, loc[:-1])[1] if loc else None
        field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
        nullable = " or None" if field is not None and type(None) in typing.get_args(field.annotation) else ""
        return f"{path}: expected {_EXPECTED[kind]}{nullable}, got {type(value).__name__} {short_repr(value)}"
    if kind in ("greater_than_equal", "less_than_equal"):
        bound = f">= {ctx['ge']}" if "ge" in ctx else f"<= {ctx['le']}"
        return f"{path}={short_repr(value)} is out of bounds: it must be {bound}"
    if kind in ("too_long", "string_too_long", "bytes_too_long"):
        unit = _UNITS.get(kind, "entries" if isinstance(value, dict) else "items")
        return f"{path} has {len(value)} {unit}, over the limit of {ctx['max_length']}"
    if kind == "finite_number":
        return f"{path}={short_repr(value)} is not allowed: it must be a finite number"
    if kind == "literal_error":
        return f"{path}={short_repr(value)} is not allowed: it must be {ctx['expected']}"
    return f"{path}: {error['msg']}"


def _union_arms(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """The leading errors that are one value failing each arm of a union: pydantic reports it once per
    arm, with the arm's name appended to loc (and a different error type for each arm)."""
    first, arms = errors[0], errors[:1]
    for error in errors[1:]:
        if (error["loc"][:-1] != first["loc"][:-1] or error["input"] is not first["input"]
                or error["type"] in {arm["type"] for arm in arms}):
            break
        arms.append(error)
    return arms


def _unexpected(cls: type[WireModel], keys: list[Any], where: Sequence[int | str] = ()) -> ProtocolError:
    path, model = _walk(cls, where)
    expected = sorted(model.model_fields) if model is not None else []
    return ProtocolError(f"{path}: unexpected field(s) {short_repr(keys)}; expected {expected}")


def _field_names(errors: list[ErrorDetails], kind: str) -> tuple[tuple, list] | None:
    """(where, names): the fields that errors of `kind` (extra_forbidden, missing) name in the model of
    the first such error, at loc `where` (() for the message itself, a nested model's field otherwise)."""
    locs = [error["loc"] for error in errors if error["type"] == kind]
    if not locs:
        return None
    return locs[0][:-1], [loc[-1] for loc in locs if loc[:-1] == locs[0][:-1]]


def protocol_error(cls: type[WireModel], exc: ValidationError) -> ProtocolError:
    """The first problem pydantic found, as a ProtocolError (a cross-field rule's own ProtocolError
    comes back as it was raised)."""
    errors = exc.errors(include_url=False)
    raised = errors[0].get("ctx", {}).get("error")
    if isinstance(raised, ProtocolError):
        return raised
    unknown = _field_names(errors, "extra_forbidden")
    if unknown:
        return _unexpected(cls, unknown[1], unknown[0])
    missing = _field_names(errors, "missing")
    if missing:
        return ProtocolError(f"{_path(cls, missing[0])}: missing field(s) {missing[1]}")
    arms = _union_arms(errors)
    if len(arms) == 1:
        return ProtocolError(_describe(cls, arms[0]))
    fitting = [arm for arm in arms if arm["type"] not in _EXPECTED]  # the arm of the value's type broke a bound
    if fitting:
        return ProtocolError(_describe(cls, {**fitting[0], "loc": fitting[0]["loc"][:-1]}))
    value, expected = arms[0]["input"], " or ".join(_EXPECTED[arm["type"]] for arm in arms)
    return ProtocolError(f"{_path(cls, arms[0]['loc'][:-1])}: expected {expected}, "
                         f"got {type(value).__name__} {short_repr(value)}")


# ---- models ----

class WireModel(BaseModel):
    """Fields that travel in a header: strict, frozen, no unknown keys, bounded strings."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", str_max_length=MAX_STR_LEN)
    type_name: ClassVar[str] = "wire"  # names the fields in errors: "kv_layer.nbytes"

    def __init__(self, /, **fields: Any) -> None:
        try:  # BaseModel.__init__, one call shorter: this is every message's path
            self.__pydantic_validator__.validate_python(fields, self_instance=self)
        except ValidationError as exc:
            raise protocol_error(type(self), exc) from None

    # It only validates, as BaseModel.__init__ does: pydantic may validate a nested model without it,
    # which keeps a peer's nested errors in the message's own ValidationError (named from the message).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


def _few_unknown(cls: type[WireModel], fields: dict) -> dict:
    """`fields` with only the first MAX_UNKNOWN_KEYS of its unknown keys, which still refuse it: pydantic would
    make an error per unknown key, and a header at the size cap holds 150,000 of them (a second's work)."""
    known = cls.model_fields
    if len(fields) <= len(known) + MAX_UNKNOWN_KEYS:
        return fields
    kept, num_unknown = {}, 0
    for key, value in fields.items():
        if key in known or num_unknown < MAX_UNKNOWN_KEYS:
            kept[key] = value
            num_unknown += key not in known
    return kept


MESSAGE_TYPES: dict[str, type[Message]] = {}


class Message(WireModel):
    """Base of every message type; subclasses register themselves under `type_name`."""

    max_frames: ClassVar[int] = 0
    nested_fields: ClassVar[tuple[str, ...]] = ()  # fields holding a WireModel: a map in the header

    def __init_subclass__(cls, *, type_name: str, max_frames: int = 0, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type_name in MESSAGE_TYPES:
            raise TypeError(f"message type {type_name!r} is already defined by {MESSAGE_TYPES[type_name].__name__}")
        cls.type_name, cls.max_frames = type_name, max_frames
        MESSAGE_TYPES[type_name] = cls

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        # pydantic calls this once the fields are known (they are not yet in __init_subclass__)
        cls.nested_fields = tuple(name for name, field in cls.model_fields.items()
                                  if _nested_model(field.annotation) is not None)

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
        """{"type", "version", then every field in declaration order}: the msgpack header map (a nested
        model's fields as a map of their own)."""
        header = {"type": self.type_name, "version": PROTOCOL_VERSION, **self.__dict__}
        for name in self.nested_fields:
            header[name] = header[name].__dict__
        return header

    @classmethod
    def from_header(cls, header: dict) -> Message:
        """Validate a header map (its "type" and "version" already checked) into this message type."""
        fields = dict(header)
        fields.pop("type", None)
        fields.pop("version", None)
        fields = _few_unknown(cls, fields)
        for name in cls.nested_fields:
            if isinstance(fields.get(name), dict):
                fields[name] = _few_unknown(_nested_model(cls.model_fields[name].annotation), fields[name])
        try:
            return cls(**fields)  # faster than model_validate, which calls a custom __init__ anyway
        except TypeError:
            unknown = [key for key in fields if not isinstance(key, str)]  # cannot be keywords
            if not unknown:
                raise
            raise _unexpected(cls, unknown) from None
