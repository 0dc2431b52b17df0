"""`pdserve decode`: an engine in the consumer role. Takes GenerateRequest on its control socket,
pulls prompt KV from the named prefill engine when it trusts it (decode.kv_peers; else it prefills
locally), decodes in its continuous batch and streams TokenDelta back to whoever sent the request. A
FirstToken from the router is the prefill engine's first token, kept if the prompt is prefilled here; it
also tells the transfer side that the prompt is computed (its KV's --kv-timeout runs from then)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pdserve.control.engine_server import EngineServer
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import FirstToken, GenerateRequest, KVPeers, new_incarnation
from pdserve.decode.kv_peers import KVPeerTrust
from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import InvalidRequestError
from pdserve.kvtransfer.fingerprint import engine_fingerprint

log = logging.getLogger("pdserve.decode")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    control_address: str = "tcp://127.0.0.1:0"
    engine_id: str = "decode-0"
    kv_timeout_s: float = 30.0  # for a prompt's KV once the prefill engine has computed it
    kv_failure: str = "recompute"
    device: str = "cpu"
    curve_dir: str | None = None  # `pdserve keygen` directory: CURVE on every socket
    kv_peers: tuple[str, ...] = ()  # prefill KV addresses trusted without the router's word (--kv-peer)
    kv_queue_timeout_s: float = 600.0  # for the prompt to be computed (the prefill engine's queue), from the KVWant


class DecodeServer(EngineServer):
    role = "decode"

    def __init__(self, *args: Any, kv_peers: KVPeerTrust | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_peers = kv_peers if kv_peers is not None else KVPeerTrust()

    def handle(self, peer_id: bytes, msg: Any) -> None:
        if isinstance(msg, FirstToken):
            self.kv_transfer.prompt_computed(msg.request_id)  # its KV's own timeout starts now
            logprobs = dict(msg.logprobs) if msg.logprobs is not None else None
            return self.engine.keep_first_token(msg.request_id, msg.token_id, logprobs)
        if not isinstance(msg, GenerateRequest):
            return super().handle(peer_id, msg)
        if msg.resume_token_ids and msg.prefill_kv_address is not None:
            raise InvalidRequestError("a resumed request (resume_token_ids) prefills here: send it without "
                                      "prefill_kv_address")
        request = self.engine.make_request(msg.request_id, list(msg.prompt_token_ids), msg.sampling_params,
                                           msg.resume_token_ids, self.kv_peers.checked(msg.prefill_kv_address))
        self.engine.add_request(request)
        self.owners[msg.request_id] = peer_id
        if request.prefill_kv_address is not None:  # its prefill engine keeps the KV while it waits here
            self.kv_transfer.hold(msg.request_id, request.prefill_kv_address)

    def on_router_message(self, msg: Any, router: str = "") -> None:
        if isinstance(msg, KVPeers):
            self.kv_peers.update_from_router(msg.kv_addresses, router, msg.incarnations)
        else:
            super().on_router_message(msg, router)


def build_decode_server(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                        options: DecodeOptions) -> DecodeServer:
    curve = load_cluster_keys(options.curve_dir) if options.curve_dir else None
    incarnation = new_incarnation()
    kv_peers = KVPeerTrust(options.kv_peers)
    transfer = DecodeTransferSide(engine_fingerprint(model_config, cache_config.block_size), options.engine_id,
                                  timeout_s=options.kv_timeout_s, curve=curve.client if curve else None,
                                  queue_timeout_s=options.kv_queue_timeout_s, incarnation=incarnation,
                                  kv_peers=kv_peers)
    engine = EngineCore(model_config, cache_config, scheduler_config, options.device,
                        connector=DecodeSchedulerSide(transfer), kv_failure_policy=options.kv_failure,
                        kv_transfer=transfer)
    transfer.bind_kv_cache(engine.runner.kv_cache)
    return DecodeServer(engine, transfer, options.control_address, options.engine_id, curve,
                        kv_peers=kv_peers, incarnation=incarnation)
