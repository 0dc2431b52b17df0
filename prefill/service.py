"""`pdserve prefill`: an engine in the producer role. Takes PrefillRequest on its control socket,
computes the prompt (batched, chunked, reusing its prefix cache) and samples the first token, sends that
token to the router at once (the client sees it before any KV moves), then serves the KV to the decode
engine that asks for it over the KV link, freeing blocks on its ack."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pdserve.control.engine_server import EngineServer
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import PrefillRequest, TokenDelta, new_incarnation
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, ServerSocket
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.layers.linear import EXACT_ROWS, warm_packed_linears
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
    hold_timeout_s: float = 600.0  # a computed prompt a decode engine has queued (KVHold) waits this long for its KVWant


class PrefillServer(EngineServer):
    role = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continuing: set[str] = set()  # requests whose first token does not end them: D goes on
        # every other request's first token ends it: the scheduler side asks, when its prompt is computed
        self.kv_transfer.first_token_ends = lambda request_id: request_id not in self.continuing

    def handle(self, peer_id: bytes, msg: Any) -> None:
        if not isinstance(msg, PrefillRequest):
            return super().handle(peer_id, msg)
        # Only the first token is sampled here; min_tokens still bans eos for it, as it would colocated.
        params = msg.sampling_params.replace(max_tokens=1, min_tokens=min(msg.sampling_params.min_tokens, 1))
        request = self.engine.make_request(msg.request_id, list(msg.prompt_token_ids), params)
        self.engine.add_request(request)
        self.owners[msg.request_id] = peer_id
        max_tokens = msg.sampling_params.max_tokens
        room_for_more = request.num_prompt_tokens + 1 < self.engine.model_config.max_model_len
        if (max_tokens is None or max_tokens > 1) and room_for_more:
            self.continuing.add(msg.request_id)
        # else the router sends it to no decode engine: its KV goes once computed (first_token_ends)

    def publish(self, deltas: list[TokenDelta]) -> None:
        """The step's first tokens go to the router first; then the KV of the prompts it computed."""
        try:
            super().publish(deltas)
        finally:
            self.kv_transfer.send_computed()

    def outgoing(self, delta: TokenDelta) -> TokenDelta | None:
        """The first token, with the finish reason it has for the whole request (a length finish that is
        only this engine's one-token cap is none: the decode engine goes on), and errors. An abort is
        the router's own doing: not echoed."""
        continuing = delta.request_id in self.continuing
        if delta.finish_reason is not None:
            self.continuing.discard(delta.request_id)
        if not delta.token_ids:
            return delta if delta.finish_reason == "error" else None
        log.debug("first token of %s published at %.6f", delta.request_id, time.time())
        if continuing and delta.finish_reason == "length":
            return TokenDelta(**{**vars(delta), "finish_reason": None})
        return delta

    @property
    def kv_address(self) -> str:
        return self.kv_transfer.server.address


def build_prefill_server(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                         options: PrefillOptions) -> PrefillServer:
    curve = load_cluster_keys(options.curve_dir) if options.curve_dir else None
    # decode engines send it only small messages (Hello, KVWant, KVAck, Abort)
    kv_server = ServerSocket(options.kv_address, curve=curve.server if curve else None,
                             max_message_bytes=CONTROL_MESSAGE_BYTES)
    incarnation = new_incarnation()
    transfer = PrefillTransferSide(kv_server, engine_fingerprint(model_config, cache_config.block_size),
                                   want_timeout_s=options.want_timeout_s, lease_s=options.lease_s,
                                   stream_layers=options.stream_layers, hold_timeout_s=options.hold_timeout_s,
                                   incarnation=incarnation)
    engine = EngineCore(model_config, cache_config, scheduler_config, options.device,
                        connector=PrefillSchedulerSide(transfer), kv_transfer=transfer)
    transfer.bind_kv_cache(engine.runner.kv_cache)
    transfer.bind_scheduler(engine.scheduler.requests.__contains__, engine.scheduler.waits_for_blocks)
    warm_linears(engine.runner.model, scheduler_config)
    return PrefillServer(engine, transfer, options.control_address, options.engine_id, curve, incarnation=incarnation)


def warm_linears(model: Any, scheduler_config: SchedulerConfig) -> None:
    """Every CPU linear shape a prefill step can reach, made before the first prompt, so the engine's memory is
    flat from then on (engine/layers/linear.warm_packed_linears): the layers' linears at every step size, the LM
    head at the exact small row counts of the sampled rows (one per prompt that ends in a step)."""
    head = model.lm_head
    warm_packed_linears((module for module in model.modules() if module is not head),
                        scheduler_config.max_num_batched_tokens)
    warm_packed_linears([head], min(scheduler_config.max_num_seqs, EXACT_ROWS))
