"""Fuzz every decoder that reads a peer's bytes (hypothesis): protocol.decode on arbitrary frames, on
arbitrary msgpack maps of every message type, and on valid headers with one field replaced; a decoded
KVLayer's payload view; a peer's layout fingerprint. Each either gives a valid message or raises
ProtocolError with a message, never another exception; headers at the size cap decode in bounded time."""

from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.control.errors import ProtocolError
from pdserve.control.protocol import decode
from pdserve.control.schema import INT64_MIN, MAX_HEADER_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, UINT64_MAX, Message
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.messages import KVLayer
from tests.control.test_protocol import FINGERPRINT, SAMPLES

pytestmark = pytest.mark.fuzz

FUZZ = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Values msgpack can carry, bounds and special floats included.
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, INT64_MIN, UINT64_MAX, 1 << 24])
SCALARS = (st.none() | st.booleans() | st.integers(INT64_MIN, UINT64_MAX) | EDGE_INTS
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40) | st.binary(max_size=40))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=6), max_leaves=25)
FRAMES = st.lists(st.binary(max_size=64), max_size=3)


def field_names(cls: type[Message]) -> list[str]:
    return sorted(cls.model_fields)


def decodes_or_refuses(parts) -> Message | None:
    """The property: a valid message, or ProtocolError with a message (anything else propagates)."""
    try:
        msg, frames = decode(parts)
    except ProtocolError as exc:
        assert str(exc).strip(), f"a ProtocolError without a message for {parts!r}"
        return None
    assert isinstance(msg, Message) and type(msg) is MESSAGE_TYPES[msg.type_name]
    if isinstance(msg, KVLayer):
        kv = msg.tensor(frames[0])  # the payload's view: the header promised exactly these bytes
        assert list(kv.shape) == list(msg.shape) and kv.numel() * kv.element_size() == msg.nbytes
    return msg


def packed(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


@FUZZ
@given(parts=st.lists(st.binary(max_size=200), max_size=4))
def test_arbitrary_frames(parts):
    decodes_or_refuses(parts)


@FUZZ
@given(value=VALUES, frames=FRAMES)
def test_arbitrary_msgpack_values_as_the_header(value, frames):
    decodes_or_refuses([packed(value), *frames])


@st.composite
def typed_maps(draw):
    """A map naming a real message type and version, with that type's field names (and others) mapped
    to arbitrary values."""
    cls = draw(st.sampled_from(sorted(MESSAGE_TYPES.values(), key=lambda c: c.type_name)))
    keys = st.text(max_size=10) | st.integers(-3, 3) | st.none()
    if cls.model_fields:
        keys = st.sampled_from(field_names(cls)) | keys
    header = draw(st.dictionaries(keys, VALUES, max_size=len(cls.model_fields) + 2))
    header["type"] = cls.type_name
    header["version"] = draw(st.just(PROTOCOL_VERSION) | VALUES)
    return header


@FUZZ
@given(header=typed_maps(), frames=FRAMES)
def test_arbitrary_maps_of_every_message_type(header, frames):
    decodes_or_refuses([packed(header), *frames])


@st.composite
def mutated_headers(draw):
    """A valid header of some message type with one field (or one nested field) replaced, or dropped."""
    msg = draw(st.sampled_from(SAMPLES))
    header = msg.to_header()
    target = header
    if msg.nested_fields and draw(st.booleans()):
        nested = draw(st.sampled_from(msg.nested_fields))
        target = header[nested] = dict(header[nested])
    name = draw(st.sampled_from(sorted(target)))
    if draw(st.integers(0, 9)) == 0:
        del target[name]
    else:
        target[name] = draw(VALUES)
    frames = [b"\x01" * msg.nbytes] if isinstance(msg, KVLayer) and draw(st.booleans()) else draw(FRAMES)
    return header, frames


@FUZZ
@given(mutated=mutated_headers())
def test_valid_headers_with_one_field_replaced(mutated):
    header, frames = mutated
    decodes_or_refuses([packed(header), *frames])


@FUZZ
@given(data=st.dictionaries(st.sampled_from(sorted(FINGERPRINT)) | st.text(max_size=8), SCALARS, max_size=9),
       base=st.booleans())
def test_a_peers_fingerprint_is_parsed_or_refused(data, base):
    fields = {**FINGERPRINT, **data} if base else data
    try:
        fingerprint = LayoutFingerprint.from_dict(fields)
    except ProtocolError as exc:
        assert str(exc).strip()
        return
    assert fingerprint.to_dict() == fields


# ---- headers at the size cap: time bounded by msgpack's own ----

def big_header(type_name: str, **fields) -> bytes:
    sample = next(msg for msg in SAMPLES if msg.type_name == type_name)
    return packed({**sample.to_header(), **fields})


MANY_KEYS = {f"{i:x}": None for i in range(150_000)}
ONE_MEGABYTE_OF = {  # each just under MAX_HEADER_BYTES, built when its test runs
    "valid token ids": lambda: big_header("generate", prompt_token_ids=[1] * 1_000_000),
    "token ids out of range": lambda: big_header("generate", prompt_token_ids=[-1] * 1_000_000),
    "token ids of the wrong type": lambda: big_header("generate", prompt_token_ids=["a"] * 500_000),
    "logprobs of the wrong type": lambda: big_header("token_delta", logprobs=[[]] * 1_000_000),
    "unknown keys": lambda: big_header("abort", **MANY_KEYS),
    "unknown nested keys": lambda: big_header("generate", sampling_params=MANY_KEYS),
}


@pytest.mark.parametrize("name", sorted(ONE_MEGABYTE_OF))
def test_a_header_at_the_size_cap_is_decoded_or_refused_in_about_the_time_msgpack_takes(name):
    """Once, each bad item or unknown key made an error of its own: a million bad token ids held an engine's
    loop for 15 s, 150,000 unknown keys for 0.6 s."""
    header = ONE_MEGABYTE_OF[name]()
    assert MAX_HEADER_BYTES // 2 < len(header) <= MAX_HEADER_BYTES
    start = time.perf_counter()
    msgpack.unpackb(header, raw=False, use_list=False, strict_map_key=False)
    unpacked = time.perf_counter()
    decodes_or_refuses([header])
    decoded = time.perf_counter()
    unpack_s, decode_s = unpacked - start, decoded - unpacked
    assert decode_s < 3 * unpack_s + 0.1, f"{name}: decode {decode_s:.2f}s, msgpack alone {unpack_s:.2f}s"
