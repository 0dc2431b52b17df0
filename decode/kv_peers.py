"""KVPeerTrust: the prefill engines a decode engine pulls KV from. Two sources only: the addresses the
operator gave (`--kv-peer`), and the registered prefill engines that each router lists in KVPeers on the
registration link this engine opened itself (with several routers: any of their lists). A control message naming any other address is served by
prefilling locally: whoever can send a GenerateRequest cannot also choose where the KV comes from. The routers
also say which incarnation is registered at each address: a new one is a restarted prefill engine."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pdserve.decode.kv_peers")

WARN_INTERVAL_S = 10.0  # an untrusted address is logged at most this often


class KVPeerTrust:
    def __init__(self, configured: tuple[str, ...] = ()) -> None:
        self.configured = frozenset(configured)
        # router address -> its latest list, each replaced whole (by that router's heartbeat thread)
        self._from_routers: dict[str, frozenset[str]] = {}
        self._incarnations: dict[str, dict[str, str]] = {}  # router address -> {KV address: incarnation}
        self._last_warning = float("-inf")
        self.num_refused = 0

    def update_from_router(self, addresses: tuple[str, ...], router: str = "",
                           incarnations: dict[str, str] | None = None) -> None:
        addresses = frozenset(addresses)
        if addresses != self._from_routers.get(router):
            log.info("prefill engines to pull KV from, as the router %s lists them: %s", router or "",
                     sorted(addresses) or "none")
        self._from_routers = {**self._from_routers, router: addresses}
        self._incarnations = {**self._incarnations, router: dict(incarnations or {})}

    def addresses(self) -> frozenset[str]:
        """Every prefill KV address trusted now: given with --kv-peer, or listed by a router."""
        return self.configured.union(*self._from_routers.values())

    def incarnation(self, address: str) -> str:
        """The incarnation a router says is registered at this KV address ("" when none says)."""
        return next((listed[address] for listed in self._incarnations.values() if listed.get(address)), "")

    def trusts(self, address: str) -> bool:
        return address in self.configured or any(address in listed for listed in self._from_routers.values())

    def checked(self, address: str | None) -> str | None:
        """address if KV may be pulled from it, else None (prefill locally)."""
        if address is None or self.trusts(address):
            return address
        self.num_refused += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL_S:
            self._last_warning = now
            log.warning("a request names prefill engine %s, which neither registered with this engine's router nor "
                        "was given with --kv-peer: prefilling locally instead (%d such requests so far)",
                        address, self.num_refused)
        return None
