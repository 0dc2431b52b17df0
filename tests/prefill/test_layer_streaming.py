"""PrefillTransferSide.layer_hook: each layer's prompt KV goes out as soon as it is stored, including for
a KVWant that arrives while the step runs (real ServerSocket/ClientSocket sockets; the engine is stood in for by
a hand-made KV cache and plan)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.messages import Hello, HelloAck, KVLayer, KVWant
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.prefill.host_copies import StreamedLayers
from pdserve.prefill.transfer_side import PrefillTransferSide
from pdserve.prefill.transfers import TransferState

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 8, 4, 2, 8
PROMPT_LEN, BLOCK_IDS = 6, [5, 2]  # two blocks, the second one partly filled


@pytest.fixture
def link():
    fingerprint = LayoutFingerprint(architecture="LlamaForCausalLM", num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, dtype="float32", block_size=BLOCK_SIZE, weights_hash="w")
    server = ServerSocket("tcp://127.0.0.1:0")
    side = PrefillTransferSide(server, fingerprint)
    kv_cache = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    side.bind_kv_cache(kv_cache)
    client = ClientSocket(server.address)
    client.send(Hello(fingerprint=fingerprint.to_dict(), role="decode", engine_id="d0"))
    _wait_until(lambda: side.receive() or client.socket.poll(0))  # P has answered the Hello
    assert isinstance(client.recv(timeout=5).msg, HelloAck)
    yield side, client, kv_cache
    client.close()
    side.close()


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.005)


def _plan(request_id: str):
    request = SimpleNamespace(request_id=request_id, num_computed_tokens=0, num_prompt_tokens=PROMPT_LEN)
    item = SimpleNamespace(request=request, block_ids=BLOCK_IDS, num_new_tokens=PROMPT_LEN)
    return SimpleNamespace(scheduled=[item])


def _expected(kv_cache: torch.Tensor, first: int, last: int) -> torch.Tensor:  # [n, 2, T, H, D]
    slots = torch.tensor([BLOCK_IDS[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(PROMPT_LEN)])
    return kv_cache[first:last + 1].flatten(2, 3).index_select(2, slots)


def _ask_for_prompt(side, client) -> None:
    """D's KVWant for the whole prompt of request "r", read by P."""
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "r" in side.transfers)


def _run_step(hook) -> None:
    """Every layer of one model step stores its KV (no hook: nothing to stream)."""
    for layer in range(NUM_LAYERS if hook is not None else 0):
        hook(layer)


def _layers_received(client: ClientSocket, count: int) -> list[tuple[KVLayer, torch.Tensor]]:
    received = []
    while len(received) < count:
        message = client.recv(timeout=5)
        assert message is not None, f"only {len(received)} of {count} KV messages arrived"
        received.append((message.msg, message.msg.tensor(message.frames[0]).clone()))
    return received


def test_want_before_the_step_streams_one_message_per_layer(link):
    side, client, kv_cache = link
    _ask_for_prompt(side, client)
    _run_step(side.layer_hook(_plan("r")))
    received = _layers_received(client, NUM_LAYERS)
    assert [(m.layer_start, m.layer_end, m.token_start, m.num_tokens) for m, _ in received] == [
        (layer, layer + 1, 0, PROMPT_LEN) for layer in range(NUM_LAYERS)]
    for layer, (_, kv) in enumerate(received):
        torch.testing.assert_close(kv, _expected(kv_cache, layer, layer), rtol=0, atol=0)
    assert side.transfers["r"].sent_upto == PROMPT_LEN


def test_want_arriving_mid_step_is_picked_up_at_the_next_layer(link):
    side, client, kv_cache = link
    hook = side.layer_hook(_plan("r"))
    assert hook is not None, "a prompt chunk without a KVWant yet must still get the hook"
    hook(0)  # nobody asked yet: nothing goes out
    assert client.recv(timeout=0.05) is None
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    time.sleep(0.05)  # the KVWant is in P's socket while layer 1 computes
    hook(1)  # reads the socket: layers 0 and 1 go out together
    hook(2)
    (catch_up, kv01), (last, kv2) = _layers_received(client, 2)
    assert (catch_up.layer_start, catch_up.layer_end, last.layer_start, last.layer_end) == (0, 2, 2, 3)
    torch.testing.assert_close(kv01, _expected(kv_cache, 0, 1), rtol=0, atol=0)
    torch.testing.assert_close(kv2, _expected(kv_cache, 2, 2), rtol=0, atol=0)
    assert side.transfers["r"].sent_upto == PROMPT_LEN


def test_no_hook_without_prompt_tokens_or_with_streaming_off(link):
    side, _, _ = link
    decode_only = _plan("r")
    decode_only.scheduled[0].request.num_computed_tokens = PROMPT_LEN
    assert side.layer_hook(decode_only) is None
    side.stream_layers = False
    assert side.layer_hook(_plan("r")) is None


@pytest.mark.parametrize("choice, device, expected", [
    ("auto", "cuda", True), ("auto", "cuda:1", True), ("auto", "cpu", False),
    ("on", "cpu", True), ("off", "cuda", False),
])
def test_kv_streaming_choice(choice, device, expected):
    from pdserve.engines import streams_layers

    assert streams_layers(choice, device) is expected


def test_a_failed_send_drops_that_transfer_and_the_step_goes_on(link, monkeypatch):
    from pdserve.control.errors import TransportTimeout

    side, client, _ = link
    _ask_for_prompt(side, client)
    hook = side.layer_hook(_plan("r"))

    def no_room(*args, **kwargs):
        raise TransportTimeout("no peer took the message")

    monkeypatch.setattr(side.server, "send", no_room)
    _run_step(hook)  # must not raise: the model step carries other requests too
    assert side.transfers["r"].state is TransferState.FAILED


class _FakeCopyEvent:
    """Stands in for the torch.cuda.Event recorded after a device-to-host copy."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_copies_still_in_flight_hold_back_later_layers_and_order_is_kept(link):
    """On CUDA a layer's KV reaches the host asynchronously: a layer whose copy has not landed is not
    sent, nor is any later one (the decode engine relies on send order); waiting sends them all."""
    side, client, kv_cache = link
    _ask_for_prompt(side, client)
    side.layer_hook(_plan("r"))  # the KVWant fits the prompt: "r" streams from this step on
    transfer = side.transfers["r"]
    pending = _FakeCopyEvent(done=False)
    for layer, ready in enumerate([pending, _FakeCopyEvent(done=True), None]):
        side.copies.append(StreamedLayers(transfer, layer, 0, _expected(kv_cache, layer, layer), ready))
    side.copies.send_landed(wait=False)
    assert client.recv(timeout=0.05) is None, "layer 0's copy is still in flight: nothing may overtake it"
    pending.done = True
    side.copies.send_landed(wait=False)
    received = _layers_received(client, NUM_LAYERS)
    assert [m.layer_start for m, _ in received] == [0, 1, 2]
    for layer, (_, kv) in enumerate(received):
        torch.testing.assert_close(kv, _expected(kv_cache, layer, layer), rtol=0, atol=0)
    side.copies.append(StreamedLayers(transfer, 0, 0, _expected(kv_cache, 0, 0), _FakeCopyEvent(done=False)))
    side.receive()  # the engine loop between steps: waits for the copy and sends it
    assert not side.copies and _layers_received(client, 1)[0][0].layer_start == 0


def test_a_recomputed_chunk_is_not_sent_twice(link):
    """After a preemption P computes the prompt again from the start; what was already streamed for
    the transfer is not sent a second time (the decode engine would count it twice)."""
    side, client, _ = link
    _ask_for_prompt(side, client)
    _run_step(side.layer_hook(_plan("r")))
    assert len(_layers_received(client, NUM_LAYERS)) == NUM_LAYERS
    _run_step(side.layer_hook(_plan("r")))  # the same chunk, recomputed after a preemption
    assert client.recv(timeout=0.1) is None, "layers already sent went out again"
    assert side.transfers["r"].sent_upto == PROMPT_LEN
