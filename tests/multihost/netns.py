"""Hosts for tests: one Linux network namespace per host, each with its own IP on one bridge, and
optional direct links between two hosts (a dedicated KV network). Everything is made by `Network` and
removed by `Network.close()`, also after a failure; `netns_refusal()` says why a kernel refuses.
Links are shaped with `tc` (netem: delay + rate; tbf: rate only, where the kernel has no netem)."""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.{net}.{sub}"  # 10.<net>.<sub>.0/24 on the bridge; host i gets .(10+i), the bridge .1


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def netns_refusal() -> str | None:
    """None when this process may create network namespaces, veths and bridges; else the reason."""
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); this test runs as uid {os.geteuid()}"
    name = f"pdprobe{secrets.token_hex(3)}"
    try:
        made = ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if made.returncode != 0:
        return f"the kernel refuses network namespaces: {made.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    namespace: str
    address: str  # its IP on the bridge
    bridge_port: str  # the veth end on the bridge, in the root namespace

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(), *command], check=check, capture_output=True, text=True,
                              timeout=10)

    def shape(self, device: str, rate_mbit: float, delay_ms: float = 0.0) -> float:
        """Cap what leaves `device` at rate_mbit, delayed by delay_ms with netem; a kernel without netem
        gets the rate cap alone (tbf, a queue deep enough never to drop). Returns the delay applied."""
        netem = ["netem", "rate", f"{rate_mbit}mbit", *(["delay", f"{delay_ms}ms"] if delay_ms else []),
                 "limit", "100000"]
        if self.run("tc", "qdisc", "replace", "dev", device, "root", *netem, check=False).returncode == 0:
            return delay_ms
        self.run("tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
                 "burst", "16kb", "limit", "8mb")
        return 0.0

    def unshape(self, device: str) -> None:
        self.run("tc", "qdisc", "del", "dev", device, "root", check=False)

    def has_netem(self, device: str) -> bool:
        added = self.run("tc", "qdisc", "replace", "dev", device, "root", "netem", "delay", "1ms", check=False)
        self.unshape(device)
        return added.returncode == 0


@dataclass
class Network:
    """A bridge in the root namespace (this process reaches every host through it at .1)."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        value = int(self.tag, 16)
        self.prefix = SUBNET.format(net=200 + value % 50, sub=value % 250)
        self.bridge = f"pdbr{self.tag}"
        self._links.append(self.bridge)
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.gateway = f"{self.prefix}.1"

    def add_host(self, name: str) -> Host:
        namespace = f"pd{self.tag}-{name}"
        ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        outside, inside = f"pd{self.tag}{name}", "eth0"
        ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", namespace)
        self._links.append(outside)
        ip("link", "set", outside, "master", self.bridge, "up")
        host = Host(namespace, f"{self.prefix}.{10 + len(self.hosts)}", outside)
        host.run("ip", "addr", "add", f"{host.address}/24", "dev", inside)
        host.run("ip", "link", "set", inside, "up")
        host.run("ip", "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def add_direct_link(self, a: Host, b: Host, device: str) -> tuple[str, str]:
        """A point-to-point veth between two hosts (device `device` on both sides); returns (a's IP, b's IP)."""
        value = int(self.tag, 16)
        prefix = f"10.{251 + value % 4}.{value % 250}"
        temporary = f"pd{self.tag}tmp"
        ip("link", "add", temporary, "netns", a.namespace, "type", "veth", "peer", "name", device, "netns", b.namespace)
        a.run("ip", "link", "set", temporary, "name", device)
        addresses = (f"{prefix}.1", f"{prefix}.2")
        for host, address in zip((a, b), addresses):
            host.run("ip", "addr", "add", f"{address}/30", "dev", device)
            host.run("ip", "link", "set", device, "up")
        return addresses

    def close(self) -> None:
        """Remove every namespace (their veth ends go with them) and the bridge; idempotent."""
        for namespace in self._namespaces:
            ip("netns", "del", namespace, check=False)
        for link in self._links:
            ip("link", "del", link, check=False)
        self._namespaces.clear()
        self._links.clear()
