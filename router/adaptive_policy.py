"""`--routing adaptive`: RoutingPolicy's interface over router/adaptive.py's choice. It reads each engine's load
from the router's ledger (EngineLink), asks `choose` for the (prefill, decode) pair, counts the decision, and
runs the lean loop (router/lean.py) when --adaptive-lean-interval is set. It predicts with the step model
scaled to the engines' reported step times (router/step_model.py's `calibrated`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

from pdserve.router.adaptive import LEAN_NONE, EngineLoad, Slo, choose
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NoEngineAvailable
from pdserve.router.lean import LEAN_NAMES, LeanController
from pdserve.router.lean_split import SplitWork, split_verdict
from pdserve.router.link import EngineLink
from pdserve.router.policies import DEFAULT_INDEX_BLOCKS, PromptHashes, Route, RoutingPolicy, engine_block_size
from pdserve.router.step_model import StepModel, calibrated, load_step_model

log = logging.getLogger("pdserve.router.adaptive")

DEFAULT_HORIZON_TOKENS = 64.0  # a request's output tokens before any has finished
HORIZON_WEIGHT = 0.05  # weight of each finished request in the running mean of output lengths
MIN_HORIZON_TOKENS, MAX_HORIZON_TOKENS = 4.0, 8192.0


class AdaptivePolicy(RoutingPolicy):
    def __init__(self, config: RouterConfig, model: StepModel | None = None) -> None:
        super().__init__(config)
        self.model = model or (load_step_model(config.step_profile) if config.step_profile else StepModel())
        self.slo = Slo(ttft_s=config.slo_ttft_ms / 1000, tpot_s=config.slo_tpot_ms / 1000)
        self.horizon_tokens = DEFAULT_HORIZON_TOKENS
        self.lean = LeanController(config.adaptive_lean_interval_s) if config.adaptive_lean_interval_s > 0 else None
        self.clock = time.monotonic
        self._calibration: tuple[tuple, StepModel] = ((), self.model)  # (the reports it was made from, the model)

    def lean_of(self, address: str) -> int:
        return self.lean.lean(address) if self.lean is not None else LEAN_NONE

    def route(self, token_ids: Sequence[int], prefills: list[EngineLink], decodes: list[EngineLink],
              force_local: bool = False, first_token_only: bool = False) -> Route:
        hashes = PromptHashes(token_ids)
        links = {link.control_address: link for link in (*prefills, *decodes)}
        prefill_capable = {link.control_address for link in prefills}
        decode_capable = {link.control_address for link in decodes}
        loads = [self._load(link, hashes, link.control_address in prefill_capable,
                            link.control_address in decode_capable) for link in links.values()]
        remote = not force_local and len(token_ids) > self.local_prefill_threshold
        model = self.calibrated_model(links.values())
        if self.lean is not None and self._lean_step(links, model, min(load.uncached_tokens for load in loads)):
            loads = [dataclasses.replace(load, lean=self.lean_of(load.address)) for load in loads]
        choice = choose(len(token_ids), loads, model, self.slo, self.horizon_tokens, allow_remote_prefill=remote)
        if choice is None:
            raise NoEngineAvailable("no decode engine is available: start one (`pdserve engine --router-address "
                                    "...`) or wait until a registered engine answers its heartbeats")
        self.decisions["local" if choice.local else "disaggregated"] += 1
        decode = links[choice.decode]
        prefill = links[choice.prefill] if choice.prefill is not None else None
        num_uncached = next(load.uncached_tokens for load in loads if load.address == choice.decode)
        if prefill is not None:
            self.index(prefill).add(hashes.for_block_size(engine_block_size(prefill)))
        if prefill is None or not first_token_only:
            self.index(decode).add(hashes.for_block_size(engine_block_size(decode)))
        return Route(decode, prefill, num_uncached, hashes)

    def _load(self, link: EngineLink, hashes: PromptHashes, can_prefill: bool, can_decode: bool) -> EngineLoad:
        block_size = engine_block_size(link)
        num_cached = self.index(link).num_matched_blocks(hashes.for_block_size(block_size)) * block_size
        blocks_total = link.stats.kv_blocks_total if link.stats and link.stats.kv_blocks_total else DEFAULT_INDEX_BLOCKS
        return EngineLoad(
            address=link.control_address, can_prefill=can_prefill, can_decode=can_decode,
            uncached_tokens=max(len(hashes.token_ids) - num_cached, 1),
            queued_prefill_tokens=link.queued_prefill_tokens, queued_prefill_squares=link.queued_prefill_squares,
            num_queued_prompts=len(link.prefilling), num_decoding=link.num_decoding,
            decode_context_tokens=link.decode_tokens, kv_free_tokens=blocks_total * block_size - link.open_tokens,
            lean=self.lean_of(link.control_address))

    def calibrated_model(self, links: Iterable[EngineLink]) -> StepModel:
        """The step model scaled by the engines' last reported step times (made again when a report changes)."""
        reports = tuple(link.stats for link in links if link.stats is not None)
        made_from = self._calibration[0]
        if len(reports) != len(made_from) or any(a is not b for a, b in zip(reports, made_from)):
            self._calibration = reports, calibrated(self.model, [report.step_times for report in reports])
        return self._calibration[1]

    def _lean_step(self, links: dict[str, EngineLink], model: StepModel, num_uncached: int) -> bool:
        """The lean loop's part in routing a prompt whose uncached part is num_uncached tokens (on the engine caching
        most of it): the prompt joins the lean's window, and a tick that is due runs first. True: a lean changed."""
        now = self.clock()
        self.lean.observe(now, model.prefill_s(num_uncached))
        if not self.lean.due(now):
            return False
        num_decoding = {address: link.num_decoding for address, link in links.items()}
        addresses = sorted(address for address, link in links.items() if link.role == "dual")
        changes = self.lean.tick(now, addresses, num_decoding, self._split(links, len(addresses), model))
        for change in changes:
            self.lean_changes[LEAN_NAMES[change.new]] += 1
            log.info("engine at %s now leans to %s (was %s)", change.address, LEAN_NAMES[change.new],
                     LEAN_NAMES[change.old])
        return bool(changes)

    def _split(self, links: dict[str, EngineLink], num_engines: int, model: StepModel):
        """The lean's verdict from the step model (router/lean_split.py), given the window's prompts."""
        num_decoding = sum(link.num_decoding for link in links.values())
        context = sum(link.decode_tokens for link in links.values())

        def verdict(prompt_rate: float, mean_prefill_s: float, num_prefill: int) -> int | None:
            work = SplitWork(num_engines, prompt_rate, mean_prefill_s, num_decoding, context, self.horizon_tokens)
            return split_verdict(work, num_prefill, model, self.slo)
        return verdict

    def record_output(self, link: EngineLink, token_ids: Sequence[int], prompt_hashes: PromptHashes | None = None
                      ) -> None:
        """As RoutingPolicy's, and the running mean of output lengths (the horizon a prefill's stall is spread over)."""
        super().record_output(link, token_ids, prompt_hashes)
        if prompt_hashes is not None:
            num_output = len(token_ids) - len(prompt_hashes.token_ids)
            mean = self.horizon_tokens + HORIZON_WEIGHT * (num_output - self.horizon_tokens)
            self.horizon_tokens = min(max(mean, MIN_HORIZON_TOKENS), MAX_HORIZON_TOKENS)

    def forget(self, link: EngineLink) -> None:
        super().forget(link)
        if self.lean is not None and not link.up:
            self.lean.forget(link.control_address)


def make_policy(config: RouterConfig) -> RoutingPolicy:
    return AdaptivePolicy(config) if config.routing == "adaptive" else RoutingPolicy(config)
