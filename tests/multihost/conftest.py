"""A cluster spread over network-namespace hosts: two routers, a prefill and a decode engine (and a
second decode engine with --kv-failure fail) each on its own host of one bridge, CURVE on every plane,
plus a direct P <-> D link that carries only KV. Every process and namespace goes at the end."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.local_cluster import ChildProcess, Driver, EngineProcess
from tests.decode.test_disaggregated import start_together
from tests.multihost.netns import Host, Network, netns_refusal

KV_DEVICE = "kv0"  # the direct P <-> D link's device on both hosts
ROUTER_PORT, REGISTRATION_PORT, CONTROL_PORT, KV_PORT = 8000, 7000, 5600, 5700
# Small blocks and chunks; 8 layers so a 200-token prompt's KV is ~400 KB, slow enough to shape.
ENGINE_ARGS = ("--block-size", "4", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "64")
KV_TIMEOUT_S, KV_LEASE_S = 4.0, 6.0
LAYERS = 8


class RouterProcess(ChildProcess):
    """`pdserve router` on a host; waits for its PDSERVE_READY line."""

    def __init__(self, host: Host, model_dir: str, curve_dir: str, log_dir: Path) -> None:
        self.log_path = log_dir / f"router-{host.namespace}.log"
        command = [*host.exec_prefix(), sys.executable, "-m", "pdserve", "router", "--model", model_dir,
                   "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                   "--registration-address", f"tcp://0.0.0.0:{REGISTRATION_PORT}", "--curve-dir", curve_dir,
                   "--log-level", "warning"]
        self.url = f"http://{host.address}:{ROUTER_PORT}"
        self.registration = f"tcp://{host.address}:{REGISTRATION_PORT}"
        self.launch(command, f"router on {host.namespace}")


@dataclass
class Cluster:
    network: Network
    hosts: dict[str, Host]
    routers: list[RouterProcess]
    prefill: EngineProcess
    decode: EngineProcess
    decode_fail: EngineProcess  # --kv-failure fail, not registered: driven directly
    kv_addresses: tuple[str, str]  # (P's, D's) IP on the direct link
    curve_dir: str

    def driver(self, decode: EngineProcess) -> Driver:
        """Drives P and `decode` directly (the router's messages), from the root namespace."""
        from pdserve.control.keys import load_cluster_keys

        return Driver(decode, self.prefill, curve=load_cluster_keys(self.curve_dir).client)

    def kv_link(self, *command: str) -> None:
        """`ip ...` on P's end of the P <-> D link."""
        self.hosts["p"].run(*command)

    def shape_kv_link(self, rate_mbit: float, delay_ms: float = 0.0) -> float:
        """Shape what P sends on the P <-> D link (the KV); returns the delay applied (0 without netem)."""
        return self.hosts["p"].shape(KV_DEVICE, rate_mbit, delay_ms)

    def unshape_kv_link(self) -> None:
        self.hosts["p"].unshape(KV_DEVICE)


def engine_on(host: Host, role: str, model_dir: str, log_dir: Path, *args: str) -> EngineProcess:
    engine = EngineProcess(role, model_dir, *ENGINE_ARGS, *args, log_dir=log_dir, launcher=tuple(host.exec_prefix()))
    # its ready line names the bind address (0.0.0.0): this namespace reaches it at the host's IP
    engine.addresses["control"] = f"tcp://{host.address}:{engine.addresses['control'].rsplit(':', 1)[1]}"
    return engine


def wait_routable(url: str, timeout_s: float = 60.0) -> None:
    """Until the router's /health counts the prefill and decode engine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            engines = httpx.get(f"{url}/health", timeout=5).json().get("engines", {})
            if engines.get("prefill", 0) >= 1 and engines.get("decode", 0) >= 1:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"engines did not register with the router at {url} within {timeout_s}s")


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    from pdserve.control.keys import write_cluster_keys

    refusal = netns_refusal()
    if refusal:
        pytest.skip(f"multi-host test needs network namespaces: {refusal}")
    log_dir = tmp_path_factory.mktemp("multihost")
    curve_dir = str(write_cluster_keys(log_dir / "keys"))
    network = Network()
    started: list = []
    try:
        hosts = {name: network.add_host(name) for name in ("r1", "r2", "p", "d")}
        kv_addresses = network.add_direct_link(hosts["p"], hosts["d"], KV_DEVICE)
        # each process imports torch and loads the model: the routers at once, then P with the unregistered decode
        # engine at once; D after P, so that P is listed when D registers (the KV address D is asserted to learn)
        routers = start_together(*(functools.partial(RouterProcess, hosts[name], model_dir, curve_dir, log_dir)
                                   for name in ("r1", "r2")))
        started += routers
        registration = [arg for router in routers for arg in ("--router-address", router.registration)]
        keys = ("--curve-dir", curve_dir)
        prefill_and_decode_fail = start_together(
            lambda: engine_on(hosts["p"], "prefill", model_dir, log_dir, *registration, *keys,
                              "--control-address", f"tcp://0.0.0.0:{CONTROL_PORT}",
                              "--kv-address", f"tcp://{kv_addresses[0]}:{KV_PORT}", "--kv-lease", str(KV_LEASE_S),
                              "--kv-want-timeout", str(KV_LEASE_S)),
            lambda: engine_on(hosts["d"], "decode", model_dir, log_dir, *keys, "--engine-id", "decode-fail",
                              "--control-address", f"tcp://0.0.0.0:{CONTROL_PORT + 1}",
                              "--kv-timeout", str(KV_TIMEOUT_S), "--kv-queue-timeout", str(KV_TIMEOUT_S),
                              "--kv-failure", "fail",
                              "--kv-peer", f"tcp://{kv_addresses[0]}:{KV_PORT}"))
        started += prefill_and_decode_fail
        prefill, decode_fail = prefill_and_decode_fail
        decode = engine_on(hosts["d"], "decode", model_dir, log_dir, *registration, *keys,
                           "--control-address", f"tcp://0.0.0.0:{CONTROL_PORT}", "--kv-timeout", str(KV_TIMEOUT_S),
                           "--kv-queue-timeout", str(KV_TIMEOUT_S))  # the driver sends no FirstToken
        started.append(decode)
        for router in routers:
            wait_routable(router.url)
        yield Cluster(network, hosts, routers, prefill, decode, decode_fail, kv_addresses, curve_dir)
    finally:
        for process in reversed(started):
            process.stop()
        network.close()
