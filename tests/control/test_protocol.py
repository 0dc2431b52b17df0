"""Wire protocol: every message type round-trips, every kind of bad input is a clear ProtocolError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import msgpack
import pytest
import torch
from pydantic import Field, ValidationError

from pdserve.control.errors import InvalidSamplingParams, ProtocolError
from pdserve.control import messages as control
from pdserve.control.messages import Abort, Error
from pdserve.control.protocol import decode, encode
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.schema import (
    MAX_DICT_ITEMS,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_STR_LEN,
    MESSAGE_TYPES,
    Message,
    PROTOCOL_VERSION,
    max_items,
)
from pdserve.kvtransfer.errors import ChecksumMismatchError
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVHold, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums, payload_checksum

FINGERPRINT = {"architecture": "LlamaForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
               "dtype": "bfloat16", "block_size": 16, "weights_hash": "ab12"}


def random_kv(dtype: torch.dtype, num_layers: int = 2, num_tokens: int = 5) -> torch.Tensor:
    """[num_layers, 2, num_tokens, 2, 8] with random bit patterns (NaN/inf payloads included)."""
    bits = torch.randint(0, 256, (num_layers * 2 * num_tokens * 2 * 8 * torch.finfo(dtype).bits // 8,), dtype=torch.uint8)
    return bits.view(dtype).view(num_layers, 2, num_tokens, 2, 8)


def kv_layer_message(dtype: torch.dtype = torch.float32) -> tuple[KVLayer, torch.Tensor]:
    kv = random_kv(dtype)
    msg, _ = KVLayer.from_tensor(kv, request_id="req-1", layer_start=4, token_start=32)
    return msg, kv


SAMPLES = [
    Hello(fingerprint=FINGERPRINT, role="decode", engine_id="decode-0"),
    HelloAck(ok=False, reason="num_kv_heads: local=2 remote=4"),
    KVWant(request_id="req-1", skip_tokens=32, num_tokens=7),
    kv_layer_message()[0],
    KVDone(request_id="req-1", first_token=42, num_tokens=7, checksum=123, first_logprobs={42: -0.25, 7: float("-inf")}),
    KVDone(request_id="req-1", first_token=42, num_tokens=7, checksum=123),
    KVAck(request_id="req-1", ok=True),
    Abort(request_id="req-1", reason="client went away"),
    Error(code="protocol_error", message="bad header"),
    Error(code="checksum_mismatch", message="corrupt", request_id="req-1"),
    # the control plane's messages (control/messages.py) share the format
    control.GenerateRequest(request_id="req-2", prompt_token_ids=[1, 2, 3],
                            sampling_params=SamplingParams(temperature=0.0, seed=5, stop_token_ids=[7]),
                            prefill_kv_address="tcp://127.0.0.1:5555"),
    control.PrefillRequest(request_id="req-2", prompt_token_ids=[1, 2, 3],
                           sampling_params=SamplingParams(top_k=5, logprobs=2)),
    control.TokenDelta(request_id="req-2", token_ids=[4], logprobs=[{4: -0.5}], finish_reason="stop"),
    control.StatsRequest(),
    control.EngineStats(engine_id="decode-0", role="decode", num_waiting=1, num_running=2, kv_blocks_used=3,
                        kv_blocks_total=64, queued_prefill_tokens=9),
    control.DescribeRequest(),
    control.Register(engine_id="prefill-0", role="prefill", control_address="tcp://127.0.0.1:5600",
                     kv_address="tcp://127.0.0.1:5700", block_size=16, max_model_len=4096, vocab_size=32000),
    control.Deregister(engine_id="decode-0", control_address="tcp://127.0.0.1:5600"),
    control.KVPeers(kv_addresses=["tcp://127.0.0.1:5700", "ipc:///tmp/p1.kv"]),
    control.FirstToken(request_id="req-2", token_id=4, logprobs={4: -0.5, 9: -2.0}),
    control.PromptLogprobs(request_id="req-2", start=1, num_positions=2, width=3, last=True),
    KVHold(request_id="req-1"),
    # incarnations (protocol version 5)
    Hello(fingerprint=FINGERPRINT, role="decode", engine_id="decode-0", incarnation="0123456789abcdef"),
    HelloAck(ok=True, incarnation="fedcba9876543210"),
    Error(code="no_hello", message="say Hello first", request_id="req-1", incarnation="fedcba9876543210"),
    control.KVPeers(kv_addresses=["tcp://127.0.0.1:5700"], incarnations={"tcp://127.0.0.1:5700": "0123456789abcdef"}),
    control.Register(engine_id="decode-0", role="decode", control_address="tcp://127.0.0.1:5601", block_size=16,
                     max_model_len=4096, vocab_size=32000, incarnation="0123456789abcdef"),
]


def header_of(msg: Message, **changes) -> bytes:
    header = msg.to_header()
    header.update(changes)
    for key in [k for k, v in changes.items() if v is DROP]:
        del header[key]
    return msgpack.packb(header)


DROP = object()


def expect_error(parts, *words: str, error=ProtocolError) -> ProtocolError:
    with pytest.raises(error) as info:
        decode(parts)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    return info.value


def test_samples_cover_every_message_type():
    assert {type(msg).type_name for msg in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type_name)
def test_round_trip(msg):
    buffers = [msg.nbytes * b"\x01"] if isinstance(msg, KVLayer) else [size * b"\x02" for size in msg.frame_sizes()]
    if isinstance(msg, KVLayer):
        msg = KVLayer(**{**vars(msg), "checksum": payload_checksum(buffers[0])})
    parts = encode(msg, *buffers)
    decoded, frames = decode([bytes(part) for part in parts])
    assert decoded == msg
    assert type(decoded) is type(msg)
    assert [bytes(f) for f in frames] == buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_tensor_round_trip_is_bit_exact(dtype):
    msg, kv = kv_layer_message(dtype)
    assert (msg.layer_end, msg.num_tokens, msg.shape) == (6, 5, (2, 2, 5, 2, 8))
    decoded, frames = decode([bytes(part) for part in encode(msg, kv)])
    received = decoded.tensor(frames[0])
    assert received.dtype == dtype and received.shape == kv.shape
    assert torch.equal(received.view(torch.uint8), kv.view(torch.uint8))


def test_tensor_view_shares_the_frame_memory():
    msg, kv = kv_layer_message(torch.bfloat16)
    frame = bytearray(bytes(encode(msg, kv)[1]))
    view = msg.tensor(memoryview(frame))
    frame[0] ^= 0xFF
    assert not torch.equal(view.view(torch.uint8), kv.view(torch.uint8))  # no copy was made


def test_non_contiguous_tensor_is_sent_in_logical_order():
    kv = random_kv(torch.float16).transpose(3, 4).contiguous().transpose(3, 4)
    assert not kv.is_contiguous()
    msg, payload = KVLayer.from_tensor(kv, request_id="r", layer_start=0, token_start=0)
    decoded, frames = decode([bytes(p) for p in encode(msg, payload)])
    assert torch.equal(decoded.tensor(frames[0]).view(torch.int16), kv.contiguous().view(torch.int16))


def test_checksum_catches_one_flipped_byte():
    msg, kv = kv_layer_message(torch.bfloat16)
    header, payload = encode(msg, kv)
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 2] ^= 0x01
    error = expect_error([header, bytes(corrupted)], "checksum", "req-1", error=ChecksumMismatchError)
    assert error.request_id == "req-1" and error.code == "checksum_mismatch"
    decode([header, bytes(corrupted)], verify_checksum=False)  # the opt-out skips only the checksum


def test_checksum_catches_corruption_patterns():
    generator = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (3 * 4088 + 100,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    base = payload_checksum(payload)
    assert payload_checksum(bytearray(payload)) == payload_checksum(memoryview(payload)) == base
    assert 0 <= base < 2 ** 64

    def changed(edit) -> bool:
        data = bytearray(payload)
        edit(data)
        return payload_checksum(bytes(data)) != base

    def flip(index: int, bit: int):
        return lambda data: data.__setitem__(index, data[index] ^ (1 << bit))

    for index in (0, 5, 4087, 4088, 3 * 4088 - 1, 3 * 4088, len(payload) - 1):  # rows, row edges, tail
        for bit in (0, 7):
            assert changed(flip(index, bit)), (index, bit)

    def swap(data, a, b, size):  # e.g. two heads of one token written in each other's place
        data[a:a + size], data[b:b + size] = data[b:b + size], data[a:a + size]

    assert changed(lambda d: swap(d, 0, 256, 256))
    assert changed(lambda d: swap(d, 1024, 9 * 1024, 1024))  # two tokens across rows
    assert changed(lambda d: swap(d, 0, 8, 8))  # neighbouring words
    assert payload_checksum(payload[:-1]) != base and payload_checksum(payload + bytes(8)) != base
    assert payload_checksum(b"") != payload_checksum(bytes(8))  # zero bytes still count


def test_combined_checksum_depends_on_order_and_count():
    assert combine_checksums([1, 2]) != combine_checksums([2, 1])
    assert combine_checksums([1, 2]) != combine_checksums([1, 2, 2])
    assert combine_checksums([1, 2]) == combine_checksums((1, 2))


def test_garbage_bytes_are_not_msgpack():
    expect_error([b"\xc1\xff\x00garbage"], "not valid msgpack")
    expect_error([b"\x92\x01"], "not valid msgpack")  # truncated array


def test_header_must_be_a_map():
    expect_error([msgpack.packb([1, 2])], "array", "map")


def test_empty_and_oversize_headers():
    expect_error([], "empty message")
    expect_error([b"\x80" * (MAX_HEADER_BYTES + 1)], "over the limit", "header")


def test_unknown_type():
    expect_error([msgpack.packb({"type": "kv_teleport", "version": PROTOCOL_VERSION})], "unknown message type", "kv_teleport", "kv_want")


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, "1", True, None])
def test_unsupported_version(version):
    expect_error([header_of(SAMPLES[2], version=version)], "unsupported protocol version", "same pdserve release")


def test_missing_field():
    error = expect_error([header_of(SAMPLES[2], skip_tokens=DROP)], "kv_want", "missing", "skip_tokens")
    assert error.request_id == "req-1"


def test_unknown_field():
    expect_error([header_of(SAMPLES[2], priority=3)], "kv_want", "unexpected", "priority")


@pytest.mark.parametrize("field, value, words", [
    ("skip_tokens", "32", ["kv_want.skip_tokens", "expected int", "str"]),
    ("skip_tokens", True, ["kv_want.skip_tokens", "expected int", "bool"]),
    ("skip_tokens", 1.5, ["kv_want.skip_tokens", "expected int", "float"]),
    ("request_id", 7, ["kv_want.request_id", "expected str"]),
    ("skip_tokens", -1, ["kv_want.skip_tokens=-1", "out of bounds"]),
    ("num_tokens", 0, ["kv_want.num_tokens=0", "out of bounds"]),
    ("request_id", "r" * 300, ["kv_want.request_id", "300 characters", "limit"]),
])
def test_wrong_type_or_bound(field, value, words):
    expect_error([header_of(SAMPLES[2], **{field: value})], *words)


def test_optional_and_nested_types():
    done = SAMPLES[4]
    expect_error([header_of(done, first_logprobs={"42": -0.1})], "kv_done.first_logprobs key", "expected int")
    expect_error([header_of(done, first_logprobs={42: "x"})], "kv_done.first_logprobs[42]", "expected float")
    expect_error([header_of(done, first_logprobs=[1.0])], "kv_done.first_logprobs", "expected dict or None")
    too_many = {i: -1.0 for i in range(30)}
    expect_error([header_of(done, first_logprobs=too_many)], "first_logprobs has 30 entries", "limit of 21")
    decoded, _ = decode([header_of(done, first_logprobs={1: 0})])  # an int where a float is declared
    assert decoded.first_logprobs == {1: 0.0} and isinstance(decoded.first_logprobs[1], float)
    assert decode([header_of(SAMPLES[8], request_id=None)])[0].request_id is None


def test_hello_fingerprint_and_role_are_checked():
    expect_error([header_of(SAMPLES[0], role="router")], "hello.role", "prefill", "decode")
    expect_error([header_of(SAMPLES[0], fingerprint={"num_layers": [2]})], "hello.fingerprint[", "expected str or int")


def test_kv_layer_shape_and_size_rules():
    msg, _ = kv_layer_message()
    expect_error([header_of(msg, shape=[1] * 9)], "kv_layer.shape has 9 items", "limit of 8")
    expect_error([header_of(msg, shape=[2, 2, 5, 2])], "kv_layer.shape", "num_kv_heads, head_dim")
    expect_error([header_of(msg, shape=[3, 2, 5, 2, 8])], "kv_layer.shape", "num_layers=2")
    expect_error([header_of(msg, nbytes=msg.nbytes + 4)], "kv_layer.nbytes", f"is {msg.nbytes} bytes")
    expect_error([header_of(msg, nbytes=MAX_FRAME_BYTES + 1)], "kv_layer.nbytes", "out of bounds")
    expect_error([header_of(msg, dtype="float64")], "kv_layer.dtype", "bfloat16")
    expect_error([header_of(msg, layer_end=msg.layer_start)], "layer_end", "greater than layer_start")


def test_frame_count_and_length_must_match_the_header():
    msg, kv = kv_layer_message()
    header, payload = encode(msg, kv)
    expect_error([header], "promises 1 payload frame(s) but 0 came")
    expect_error([header, bytes(payload), b"x"], "at most 1 payload frame(s), got 2")
    expect_error([header, bytes(payload)[:-1]], "frame 0 has", f"promises {msg.nbytes}")
    expect_error([encode(SAMPLES[2])[0], b"payload"], "kv_want carries at most 0")


def test_construction_validates_locally():
    with pytest.raises(ProtocolError, match="kv_want.skip_tokens"):
        KVWant(request_id="r", skip_tokens="3", num_tokens=1)
    with pytest.raises(TypeError):
        KVWant("r", 0, 1)  # keyword-only: field order never matters


# Golden headers: the KV layer's as the hand-written validator this schema replaced wrote it; the wire
# must not change unless a message's shape does (or the protocol version: 6 since window-only KV).
GOLDEN_KV_LAYER = (
    "8ba474797065a86b765f6c61796572a776657273696f6e06aa726571756573745f6964a57265712d31ab6c617965725f7374"
    "61727404a96c617965725f656e6406ab746f6b656e5f737461727420aa6e756d5f746f6b656e7305a56474797065a862666c"
    "6f61743136a57368617065950202050208a66e6279746573cd0280a8636865636b73756dcf0123456789abcdef")
GOLDEN_GENERATE = (  # SamplingParams nested (control/sampling_params.py), structured_kind/spec last; resume_token_ids
    "87a474797065a867656e6572617465a776657273696f6e06aa726571756573745f6964a57265712d32b070726f6d70745f74"
    "6f6b656e5f69647393010203af73616d706c696e675f706172616d73de0015a16e01ab74656d7065726174757265cb000000"
    "0000000000a5746f705f70cb3ff0000000000000a5746f705f6b00a56d696e5f70cb0000000000000000a47365656405b272"
    "657065746974696f6e5f70656e616c7479cb3ff0000000000000b070726573656e63655f70656e616c7479cb000000000000"
    "0000b16672657175656e63795f70656e616c7479cb0000000000000000aa6d61785f746f6b656e7310aa6d696e5f746f6b65"
    "6e7300a473746f7090ae73746f705f746f6b656e5f6964739107aa69676e6f72655f656f73c2a86c6f6770726f6273c0b373"
    "6b69705f7370656369616c5f746f6b656e73c3ba696e636c7564655f73746f705f7374725f696e5f6f7574707574c2aa6c6f"
    "6769745f6269617390af70726f6d70745f6c6f6770726f6273c0af737472756374757265645f6b696e64c0af737472756374"
    "757265645f73706563a0b270726566696c6c5f6b765f61646472657373a77463703a2f2f61b0726573756d655f746f6b656e"
    "5f69647390")


def test_headers_are_byte_identical_to_the_first_schema():
    layer = KVLayer(request_id="req-1", layer_start=4, layer_end=6, token_start=32, num_tokens=5, dtype="bfloat16",
                    shape=[2, 2, 5, 2, 8], nbytes=640, checksum=0x0123456789ABCDEF)
    assert bytes(encode(layer, bytes(640))[0]).hex() == GOLDEN_KV_LAYER
    generate = control.GenerateRequest(request_id="req-2", prompt_token_ids=[1, 2, 3], prefill_kv_address="tcp://a",
                                       sampling_params=SamplingParams(temperature=0, seed=5, stop_token_ids=[7]))
    assert bytes(encode(generate)[0]).hex() == GOLDEN_GENERATE
    assert decode([bytes.fromhex(GOLDEN_GENERATE)])[0] == generate


def test_messages_are_immutable_and_lists_become_tuples():
    msg = control.TokenDelta(request_id="r", token_ids=[1, 2], logprobs=[{1: -0.5}])
    assert msg.token_ids == (1, 2) and isinstance(msg.logprobs, tuple)
    with pytest.raises(ValidationError, match="frozen"):  # pydantic refuses the assignment
        msg.token_ids = (3,)
    with pytest.raises(ProtocolError, match="token_delta.token_ids: expected list, got set"):
        control.TokenDelta(request_id="r", token_ids={1, 2})  # unordered: never a list on the wire
    assert control.EngineStats(**{**vars(SAMPLES[14]), "kv_transfer_seconds": 2}).kv_transfer_seconds == 2.0


@pytest.mark.parametrize("field, value, words", [
    ("skip_tokens", True, ["kv_want.skip_tokens", "expected int, got bool"]),  # bool is an int in Python only
    ("skip_tokens", 3.0, ["kv_want.skip_tokens", "expected int, got float"]),
    ("request_id", b"req-1", ["kv_want.request_id", "expected str, got bytes"]),
    ("request_id", "r" * (MAX_STR_LEN + 1), ["kv_want.request_id has 4097 characters", "limit of 256"]),
])
def test_no_coercion_when_building_either(field, value, words):
    with pytest.raises(ProtocolError) as info:
        KVWant(**{"request_id": "req-1", "skip_tokens": 0, "num_tokens": 1, field: value})
    assert all(word in str(info.value) for word in words), str(info.value)


def test_sizes_are_counted_before_items_are_checked():
    too_many = {str(i): [i] for i in range(MAX_DICT_ITEMS + 1)}  # every value is also of the wrong type
    expect_error([header_of(SAMPLES[0], fingerprint=too_many)], f"hello.fingerprint has {MAX_DICT_ITEMS + 1} entries")
    expect_error([header_of(SAMPLES[4], first_logprobs={i: "x" for i in range(22)})], "first_logprobs has 22 entries")
    expect_error([header_of(SAMPLES[0], fingerprint={"weights_hash": "f" * 5000})],
                 "hello.fingerprint['weights_hash'] has 5000 characters", "limit of 4096")
    expect_error([header_of(SAMPLES[0], fingerprint={"x" * 5000: 1})], "hello.fingerprint key has 5000 characters")


def test_header_keys_that_are_not_strings():
    header = msgpack.packb({**SAMPLES[2].to_header(), 7: "x"})
    error = expect_error([header], "kv_want", "unexpected field(s) [7]")
    assert error.request_id == "req-1"


def test_sampling_params_check_the_wire_bounds_on_their_own():
    with pytest.raises(InvalidSamplingParams, match=r"top_k=-2 must be -1 or 0"):
        SamplingParams(top_k=-2)
    with pytest.raises(InvalidSamplingParams, match=r"sampling_params.stop_token_ids has 65 items"):
        SamplingParams(stop_token_ids=list(range(65)))
    with pytest.raises(InvalidSamplingParams, match=r"sampling_params.temperature=inf is not allowed"):
        SamplingParams(temperature=float("inf"))
    params = SamplingParams(temperature=0, seed=3, stop="x", stop_token_ids=[5])
    assert (params.temperature, params.seed, params.stop, params.stop_token_ids) == (0.0, 3, ("x",), (5,))
    assert params.replace(max_tokens=1).max_tokens == 1 and params.max_tokens == 16
    with pytest.raises(InvalidSamplingParams, match="min_tokens=4 must not exceed max_tokens=1"):
        params.replace(min_tokens=4, max_tokens=1)  # a copy is validated again


def test_sampling_params_name_the_field_at_fault_and_travel_whole():
    for fields, field in (({"temperature": 101}, "temperature"), ({"stop": ["x"] * 17}, "stop"),
                          ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"top_k": "5"}, "top_k"),
                          ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")):
        with pytest.raises(InvalidSamplingParams) as refused:
            SamplingParams(**fields)
        assert refused.value.field == field, (fields, str(refused.value))
    params = SamplingParams(stop="x", min_tokens=2, include_stop_str_in_output=True)
    request = control.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling_params=params)
    assert decode(encode(request))[0].sampling_params == params


def _generate_header(**sampling) -> bytes:
    header = SAMPLES[10].to_header()
    return msgpack.packb({**header, "sampling_params": {**header["sampling_params"], **sampling}})


def test_a_peers_sampling_values_out_of_range_are_an_invalid_request():
    error = expect_error([_generate_header(temperature=-1.0)], "temperature=-1.0 must be >= 0",
                         error=InvalidSamplingParams)
    assert (error.code, error.request_id) == ("invalid_request", "req-2")
    error = expect_error([_generate_header(top_k="5")], "generate.sampling_params.top_k: expected int, got str")
    assert (error.code, error.request_id) == ("protocol_error", "req-2"), "a malformed header is not a request"
    expect_error([_generate_header(max_tokens=1.5)], "generate.sampling_params.max_tokens: expected int or None")
    expect_error([_generate_header(best_of=2)], "generate.sampling_params: unexpected field(s) ['best_of']")
    expect_error([_generate_header(stop=["x"] * 17)], "generate.sampling_params.stop has 17 items")
    expect_error([header_of(SAMPLES[10], sampling_params=5)], "generate.sampling_params: expected dict, got int")


def test_encode_checks_buffers_against_the_header():
    msg, kv = kv_layer_message()
    with pytest.raises(ProtocolError, match="promises 1 payload frame"):
        encode(msg)
    with pytest.raises(ProtocolError, match="frame 0 has"):
        encode(msg, kv[:1])
    with pytest.raises(TypeError, match="cannot send a str"):
        encode(msg, "not a buffer")


def test_error_reply_from_exception():
    error = ProtocolError("kv_want.skip_tokens: bad", request_id="req-9")
    reply = Error.from_exception(error)
    assert (reply.code, reply.request_id, reply.message) == ("protocol_error", "req-9", "kv_want.skip_tokens: bad")
    assert Error.from_exception(RuntimeError("x" * 10_000)).code == "internal_error"
    assert decode(encode(Error.from_exception(RuntimeError("x" * 10_000))))[0].message == "x" * 4096


def test_a_new_message_type_is_a_few_lines():
    class Probe(Message, type_name="test_probe", max_frames=2):
        token_ids: Annotated[tuple[Annotated[int, Field(ge=0)], ...], max_items(4)]
        blob: bytes = Field(max_length=8)
        load: float
        note: str | None = None

        def frame_sizes(self) -> tuple[int, ...]:
            return (3, 1)

    try:
        probe = Probe(token_ids=[1, 2], blob=b"ab", load=1)
        decoded, frames = decode([bytes(p) for p in encode(probe, b"abc", b"d")])
        assert [bytes(f) for f in frames] == [b"abc", b"d"]
        assert decoded == probe and decoded.token_ids == (1, 2) and decoded.load == 1.0
        expect_error([header_of(probe, token_ids=[1, 2, 3, 4, 5]), b"abc", b"d"], "test_probe.token_ids has 5 items")
        expect_error([header_of(probe, token_ids=[1, -2]), b"abc", b"d"], "test_probe.token_ids[1]=-2")
        expect_error([header_of(probe, blob=b"x" * 9), b"abc", b"d"], "test_probe.blob has 9 bytes")
        with pytest.raises(TypeError, match="already defined"):
            type("Again", (Message,), {}, type_name="test_probe")
    finally:
        del MESSAGE_TYPES["test_probe"]


def test_speaking_the_protocol_does_not_load_torch():
    code = ("import sys, pdserve.control.protocol, pdserve.control.sockets, pdserve.control.messages, "
            "pdserve.kvtransfer.messages, pdserve.kvtransfer.fingerprint; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0


@pytest.mark.parametrize("incarnation", ["G" * 16, "a" * 33, 7])
def test_an_incarnation_is_short_lowercase_hex(incarnation):
    with pytest.raises(ProtocolError, match="hello_ack.incarnation"):
        HelloAck(ok=True, incarnation=incarnation)
    with pytest.raises(ProtocolError, match="kv_peers.incarnations"):
        control.KVPeers(kv_addresses=["tcp://a:1"], incarnations={"tcp://a:1": incarnation})


def test_a_fresh_incarnation_is_new_each_time():
    made = {control.new_incarnation() for _ in range(100)}
    assert len(made) == 100 and all(len(i) == 16 and HelloAck(ok=True, incarnation=i) for i in made)
