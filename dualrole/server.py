"""`pdserve engine`: an engine that takes either role, per request (docs/serving/dual-role.md).

    PrefillRequest                               -> the prefill role: first token to the router, the
                                                    prompt's KV held and served to a decode peer
    GenerateRequest naming a peer's KV address   -> the decode role: the KV pulled from that peer, when
                                                    trusted (--kv-peer or the router's KVPeers)
    GenerateRequest naming none (or this engine) -> colocated: prefilled and decoded here
    FirstToken, KVPeers, Abort                   -> as a decode engine takes them

It is PrefillServer and DecodeServer in one process, over one engine and one KV cache: their request
handling as it is, with the two roles' connectors side by side (dualrole/connector.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pdserve.control.engine_server import EngineServer
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import (EngineStats, GenerateRequest, KVSideStats, PrefillRequest, TokenDelta,
                                      new_incarnation)
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, ServerSocket
from pdserve.decode.kv_peers import KVPeerTrust
from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.service import DecodeOptions, DecodeServer
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.dualrole.connector import DualSchedulerSide, DualTransferSide
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.kvtransfer.fingerprint import engine_fingerprint
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.service import PrefillOptions, PrefillServer
from pdserve.prefill.transfer_side import PrefillTransferSide

log = logging.getLogger("pdserve.dualrole")


@dataclasses.dataclass(frozen=True)
class DualRoleOptions:
    """The two roles' options. The engine's own (control address, engine id, device, CURVE keys) are the
    decode options'; the prefill options give the KV socket and how long computed prompts wait for peers."""

    prefill: PrefillOptions = PrefillOptions(engine_id="engine-0")
    decode: DecodeOptions = DecodeOptions(engine_id="engine-0")


class DualRoleServer(PrefillServer, DecodeServer):
    """PrefillServer's handling of PrefillRequest, DecodeServer's of the rest (the method order does it)."""

    role = "dual"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefilling: set[str] = set()  # requests that came as PrefillRequest: their deltas follow its rules

    def handle(self, peer_id: bytes, msg: Any) -> None:
        if isinstance(msg, GenerateRequest) and msg.prefill_kv_address in self.own_kv_addresses():
            msg = msg.model_copy(update={"prefill_kv_address": None})  # its prompt is computed here: colocated
        super().handle(peer_id, msg)
        if isinstance(msg, PrefillRequest):  # accepted (a refused one raised)
            self.prefilling.add(msg.request_id)

    def own_kv_addresses(self) -> set[str]:
        """This engine's KV address as bound and as each router was told it."""
        return {self.kv_address, *(heartbeat.register.kv_address for heartbeat in self.heartbeats)}

    def stats(self) -> EngineStats:
        """The engine's figures, its KV figures also split by the role it took in each transfer."""
        sides = self.kv_transfer.prefill.stats, self.kv_transfer.decode.stats
        return super().stats().model_copy(update={
            "kv_prefill_side": KVSideStats(**dataclasses.asdict(sides[0])),
            "kv_decode_side": KVSideStats(**dataclasses.asdict(sides[1]))})

    def outgoing(self, delta: TokenDelta) -> TokenDelta | None:
        """A prefill-role request's deltas as a prefill engine sends them (the first token, errors); any
        other request's as they are."""
        if delta.request_id not in self.prefilling:
            return EngineServer.outgoing(self, delta)
        if delta.finish_reason is not None:
            self.prefilling.discard(delta.request_id)
        return PrefillServer.outgoing(self, delta)


def build_dual_role_server(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                           options: DualRoleOptions) -> DualRoleServer:
    own, serving = options.decode, options.prefill
    curve = load_cluster_keys(own.curve_dir) if own.curve_dir else None
    incarnation = new_incarnation()
    fingerprint = engine_fingerprint(model_config, cache_config.block_size)
    # peers pulling KV send it only small messages (Hello, KVWant, KVAck, Abort)
    kv_server = ServerSocket(serving.kv_address, curve=curve.server if curve else None,
                             max_message_bytes=CONTROL_MESSAGE_BYTES)
    sending = PrefillTransferSide(kv_server, fingerprint, want_timeout_s=serving.want_timeout_s,
                                  lease_s=serving.lease_s, stream_layers=serving.stream_layers,
                                  hold_timeout_s=serving.hold_timeout_s, incarnation=incarnation)
    kv_peers = KVPeerTrust(own.kv_peers)
    pulling = DecodeTransferSide(fingerprint, own.engine_id, timeout_s=own.kv_timeout_s,
                                 curve=curve.client if curve else None, queue_timeout_s=own.kv_queue_timeout_s,
                                 incarnation=incarnation, kv_peers=kv_peers)
    transfer = DualTransferSide(sending, pulling, release_pulls=own.kv_failure == "recompute")
    connector = DualSchedulerSide(PrefillSchedulerSide(sending), DecodeSchedulerSide(pulling))
    engine = EngineCore(model_config, cache_config, scheduler_config, own.device, connector=connector,
                        kv_failure_policy=own.kv_failure, kv_transfer=transfer)
    transfer.bind_kv_cache(engine.runner.kv_cache)
    sending.bind_scheduler(engine.scheduler.requests.__contains__, engine.scheduler.waits_for_blocks)
    return DualRoleServer(engine, transfer, own.control_address, own.engine_id, curve,
                          kv_peers=kv_peers, incarnation=incarnation)
