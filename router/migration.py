"""Request migration: a choice whose decode engine is lost mid-stream (its process died, or it stopped
beating for --heartbeat-timeout) goes on on another decode engine, in the same client stream.

    migration = Migration(gateway, deadline)
    migration.lose(exc)                                  # the relay raised Migrate
    submission = await migration.resume(relay, submit)   # the relay resumed on a new attempt (or EngineFailed)

The new attempt sends the prompt with the tokens the client already has as resume_token_ids (never as
prompt text), and the decode engine prefills both itself: greedy and seeded output, max_tokens, stop strings
(the relay keeps its detokenizer), logprobs, usage and a structured-output matcher all continue. An engine
is waited for up to --migration-timeout (a restarted one may come back); then the stream ends with the
in-band error. Each outcome is counted in pdserve_router_migrations_total. docs/serving/migration.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pdserve.router.errors import EngineFailed, NoEngineAvailable
from pdserve.router.policies import Route
from pdserve.router.relay import Migrate, Relay, Retry

log = logging.getLogger("pdserve.router.migration")

# Migrations of one choice: a request that takes down every engine it reaches is not passed on for ever.
MAX_MIGRATIONS = 3
POLL_S = 0.05  # how often a migration that found no decode engine looks again


class Migration:
    """One choice's migrations: the decode engines it lost, and how many times it moved."""

    def __init__(self, gateway: Any, request_id: str, deadline: float) -> None:
        self.gateway = gateway  # router.gateway.Gateway
        self.request_id = request_id
        self.deadline = deadline  # loop time: the request's own timeout bounds a migration too
        self.excluded: set[str] = set()  # control addresses of the engines lost (taken again only if alone)
        self.num_migrations = 0
        self.reason = ""  # why the last engine was lost

    def lose(self, lost: Migrate) -> None:
        self.excluded.add(lost.exclude)
        self.reason = str(lost)

    async def resume(self, relay: Relay, submit: Callable[[Route], Any]) -> Any:
        """A new attempt that goes on after the relay's tokens, from submit(route), with the relay resumed on
        it; EngineFailed (the stream's in-band error) when no decode engine takes it within the bound."""
        timeout_s = self.gateway.config.migration_timeout_s
        if self.num_migrations >= MAX_MIGRATIONS or timeout_s <= 0:
            why = "migration is off (--migration-timeout 0)" if timeout_s <= 0 else f"it moved {MAX_MIGRATIONS} times"
            raise self._failed(f"{why}; {self.reason}")
        self.num_migrations += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        give_up = min(started + timeout_s, self.deadline)
        token_ids = relay.spec.prompt_token_ids + relay.token_ids
        while True:
            try:
                submission = submit(self.gateway.route(token_ids, self.excluded, force_local=True))
                break
            except NoEngineAvailable:
                pass
            except Retry as exc:  # the engine picked could not take it: another, while the bound lasts
                if exc.exclude:
                    self.excluded.add(exc.exclude)
            if loop.time() >= give_up:
                raise self._failed(f"no decode engine took it over within {loop.time() - started:.1f}s "
                                   f"(--migration-timeout {timeout_s:g}); {self.reason}")
            await asyncio.sleep(POLL_S)
        relay.resume(submission)
        self.gateway.metrics.count_migration("resumed")
        log.warning("request %s: %s; resumed after %d tokens on decode engine %s (%.2fs)", self.request_id,
                    self.reason, len(relay.token_ids), submission.route.decode.engine_id, loop.time() - started)
        return submission

    def _failed(self, reason: str) -> EngineFailed:
        self.gateway.metrics.count_migration("failed")
        return EngineFailed(f"the request failed and cannot be retried: {reason}")
