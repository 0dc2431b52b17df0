"""Gateway: the long-lived state of one router process (tokenizer and its threads, engines, policy,
metrics, admission) that the API handlers and the generation code share."""

from __future__ import annotations

import asyncio

from pdserve.engine.generation_defaults import load_generation_defaults
from pdserve.router.adaptive_policy import make_policy
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NoEngineAvailable, Overloaded
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Route
from pdserve.router.preprocess import Preprocessor
from pdserve.router.registry import EngineRegistry
from pdserve.router.template_sandbox import TemplateSandbox
from pdserve.router.tokenization import Tokenization


class Gateway:
    def __init__(self, config: RouterConfig, tokenization: Tokenization | None = None,
                 registry: EngineRegistry | None = None) -> None:
        self.config = config
        self.tokenization = tokenization or Tokenization(config.model, config.chat_template)
        self.generation_defaults = load_generation_defaults(config.model)  # generation_config.json's sampling
        self.preprocessor = Preprocessor(config.num_preprocess_threads, config.preprocess_timeout_s,
                                         max_waiting=config.max_concurrent_requests)
        # request-supplied chat templates are rendered in killable worker processes, started with the router
        self.template_sandbox = (TemplateSandbox(config.model, config.preprocess_timeout_s)
                                 if config.allow_request_chat_template else None)
        self.registry = registry or EngineRegistry(config)
        self.policy = make_policy(config)
        self.metrics = RouterMetrics(self.registry.links, self.policy)
        self.num_in_flight = 0
        self.registry.on_change.append(self.policy.forget)

    async def start(self) -> None:
        await self.registry.start()
        if self.template_sandbox is not None:  # ready before the router says it is
            await asyncio.to_thread(self.template_sandbox.wait_started)

    async def close(self) -> None:
        self.preprocessor.close()
        if self.template_sandbox is not None:
            self.template_sandbox.close()
        await self.registry.close()

    # ---- admission ----

    def admit(self) -> None:
        """Count a request in, or refuse it when the router is at its limit (429)."""
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise Overloaded(f"the server is serving its limit of {self.config.max_concurrent_requests} requests: "
                             f"retry later (or raise --max-concurrent-requests)")
        self.num_in_flight += 1
        self.metrics.in_flight.set(self.num_in_flight)

    def release(self) -> None:
        self.num_in_flight -= 1
        self.metrics.in_flight.set(self.num_in_flight)

    # ---- routing ----

    def context_limits(self) -> tuple[int, int | None]:
        """(max_model_len, vocab_size) the routable decode engines accept, or 503 when there are none."""
        limits = self.registry.decode_limits()
        if limits is None:
            raise NoEngineAvailable("no decode engine is available: start one (`pdserve decode --router-address "
                                    f"{self.registry.registration_address}`) or wait until one answers")
        return limits

    def route(self, token_ids: list[int], excluded: set[str], force_local: bool,
              first_token_only: bool = False) -> Route:
        """Engines for one attempt; engines that failed this request are avoided while others exist
        (no prefill engine left = prefill on the decode engine). first_token_only: a prefill engine's first
        token is the whole answer, so the decode engine will not see the prompt."""
        prefills = [link for link in self.registry.engines("prefill") if link.control_address not in excluded]
        decodes = self.registry.engines("decode")
        decodes = [link for link in decodes if link.control_address not in excluded] or decodes
        return self.policy.route(token_ids, prefills, decodes, force_local, first_token_only)
