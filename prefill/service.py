"""`pdserve prefill`: an engine in the producer role. Takes PrefillRequest on its control socket,
computes the prompt (batched, chunked, reusing its prefix cache) and samples the first token, then
serves the KV to the decode engine that asks for it over the KV link, freeing blocks on its ack."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pdserve.control.engine_server import EngineServer
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import PrefillRequest, TokenDelta
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, ServerSocket
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.kvtransfer.fingerprint import engine_fingerprint
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfer_side import PrefillTransferSide

log = logging.getLogger("pdserve.prefill")


@dataclasses.dataclass(frozen=True)
class PrefillOptions:
    control_address: str = "tcp://127.0.0.1:0"
    kv_address: str = "tcp://127.0.0.1:0"
    engine_id: str = "prefill-0"
    want_timeout_s: float = 30.0
    lease_s: float = 30.0
    device: str = "cpu"
    stream_layers: bool = True
    curve_dir: str | None = None  # `pdserve keygen` directory: CURVE on every socket


class PrefillServer(EngineServer):
    role = "prefill"

    def handle(self, peer_id: bytes, msg: Any) -> None:
        if not isinstance(msg, PrefillRequest):
            return super().handle(peer_id, msg)
        # Only the first token is sampled here; min_tokens still bans eos for it, as it would colocated.
        params = msg.sampling_params.replace(max_tokens=1, min_tokens=min(msg.sampling_params.min_tokens, 1))
        request = self.engine.make_request(msg.request_id, list(msg.prompt_token_ids), params)
        self.engine.add_request(request)
        self.owners[msg.request_id] = peer_id

    def should_publish(self, delta: TokenDelta) -> bool:
        # The router hears about a prefill only when it failed; tokens reach it through the decode engine.
        return delta.finish_reason == "error"

    @property
    def kv_address(self) -> str:
        return self.kv_transfer.server.address


def build_prefill_server(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                         options: PrefillOptions) -> PrefillServer:
    curve = load_cluster_keys(options.curve_dir) if options.curve_dir else None
    # decode engines send it only small messages (Hello, KVWant, KVAck, Abort)
    kv_server = ServerSocket(options.kv_address, curve=curve.server if curve else None,
                             max_message_bytes=CONTROL_MESSAGE_BYTES)
    transfer = PrefillTransferSide(kv_server, engine_fingerprint(model_config, cache_config.block_size),
                                   want_timeout_s=options.want_timeout_s, lease_s=options.lease_s,
                                   stream_layers=options.stream_layers)
    engine = EngineCore(model_config, cache_config, scheduler_config, options.device,
                        connector=PrefillSchedulerSide(transfer), kv_transfer=transfer)
    transfer.bind_kv_cache(engine.runner.kv_cache)
    return PrefillServer(engine, transfer, options.control_address, options.engine_id, curve)
