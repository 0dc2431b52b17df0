"""KV messages about requests the decode engine did not ask for: dropped and logged, never written."""

from __future__ import annotations

import logging
import time

import torch

from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.request import Request, SamplingParams
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.messages import Hello, HelloAck, KVDone, KVLayer, KVWant
from pdserve.control.sockets import ServerSocket
from tests.decode.test_incoming_states import recv_flushing

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 4, 4, 2, 8


def test_kv_for_a_request_nobody_asked_for_is_dropped(caplog):
    fingerprint = LayoutFingerprint(architecture="LlamaForCausalLM", num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, dtype="float32", block_size=BLOCK_SIZE, weights_hash="w")
    prefill = ServerSocket("tcp://127.0.0.1:0")  # plays a prefill engine that sends unasked KV
    side = DecodeTransferSide(fingerprint, "d0", timeout_s=5)
    scheduler_side = DecodeSchedulerSide(side)
    kv_cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    side.bind_kv_cache(kv_cache)
    asked = Request("asked", [1, 2, 3, 4], SamplingParams(max_tokens=1), max_tokens=1)
    asked.prefill_kv_address = prefill.address
    try:
        scheduler_side.on_blocks_allocated(asked, [0], 4)  # D opens the link with Hello, then asks
        hello = recv_flushing(prefill, side)
        assert isinstance(hello.msg, Hello)
        prefill.send(hello.peer_id, HelloAck(ok=True))
        assert isinstance(recv_flushing(prefill, side).msg, KVWant)
        msg, payload = KVLayer.from_tensor(torch.randn(NUM_LAYERS, 2, 4, KV_HEADS, HEAD_DIM), request_id="nobody",
                                           layer_start=0, token_start=0)
        prefill.send(hello.peer_id, msg, payload)
        prefill.send(hello.peer_id, KVDone(request_id="nobody", first_token=1, num_tokens=4, checksum=msg.checksum))
        time.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger="pdserve.decode.transfer_side"):
            side.receive()  # must not raise
        assert "KV for unknown request nobody" in caplog.text and "KVDone for unknown request nobody" in caplog.text
        assert not kv_cache.any(), "unasked KV must never reach the cache"
        events = scheduler_side.poll()
        assert not events.received and not events.failed and side.stats.kv_bytes_received == 0
    finally:
        side.close()
        prefill.close()
