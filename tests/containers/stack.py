"""One compose project driven through podman-compose and podman, for the container tests.

The project gets its own name (so its containers, network and volumes are told apart from a user's
stack) and its own published port; everything it made is found again by compose's project label.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_LABEL = "io.podman.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


def missing_tools() -> str | None:
    """Why the container tests cannot run here, or None."""
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (deploy/container_smoke.sh installs it)"
    probe = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return f"podman cannot run containers here: {probe.stderr.strip()[-300:]}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


@dataclass
class ComposeStack:
    repo: Path
    compose_file: str
    project: str
    env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 900) -> str:
        # no pod: each service its own container, as with docker compose (podman applies no restart policy in a pod)
        command = ["podman-compose", "--in-pod", "false", "-f", self.compose_file, "-p", self.project, *args]
        result = subprocess.run(command, cwd=self.repo, env={**os.environ, **self.env}, capture_output=True,
                                text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                               f"{result.stderr[-3000:]}")
        return result.stdout + result.stderr

    def containers(self, service: str | None = None, running_only: bool = False) -> list[dict]:
        args = ["ps", "--format", "json", "--filter", f"label={PROJECT_LABEL}={self.project}"]
        if service:
            args += ["--filter", f"label={SERVICE_LABEL}={service}"]
        if not running_only:
            args.append("--all")
        return json.loads(podman(*args).stdout or "[]")

    def names(self, service: str) -> list[str]:
        return sorted(c["Names"][0] for c in self.containers(service, running_only=True))

    def inspect(self, name: str) -> dict:
        return json.loads(podman("inspect", name).stdout)[0]

    def volumes(self) -> set[str]:
        out = podman("volume", "ls", "--format", "{{.Name}}", "--filter", f"label={PROJECT_LABEL}={self.project}")
        return set(out.stdout.split())

    def networks(self) -> set[str]:
        out = podman("network", "ls", "--format", "{{.Name}}", "--filter", f"label={PROJECT_LABEL}={self.project}")
        return set(out.stdout.split())

    def volume_path(self, volume: str) -> Path:
        """Where a project volume lies on this host (rootful podman: readable here)."""
        out = podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{self.project}_{volume}")
        return Path(out.stdout.strip())

    def wait_healthy(self, timeout: float) -> dict[str, float]:
        """Run each running container's own healthcheck until it passes; seconds each took.

        podman runs healthchecks from systemd timers; where there is no systemd they never fire by
        themselves, so this runs them (`podman healthcheck run`), which also records the status."""
        start = time.monotonic()
        pending = {c["Names"][0] for c in self.containers(running_only=True) if self._has_healthcheck(c["Names"][0])}
        took: dict[str, float] = {}
        while pending:
            for name in sorted(pending):
                if podman("healthcheck", "run", name, check=False, timeout=60).returncode == 0:
                    took[name] = time.monotonic() - start
                    pending.discard(name)
            if pending and time.monotonic() - start > timeout:
                logs = {name: podman("logs", "--tail", "30", name, check=False).stderr[-1500:] for name in pending}
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {sorted(pending)}; last logs: {logs}")
            time.sleep(2)
        return took

    def _has_healthcheck(self, name: str) -> bool:
        check = self.inspect(name)["Config"].get("Healthcheck") or {}
        return bool(check.get("Test")) and check["Test"][0] != "NONE"

    def remove_everything(self) -> None:
        """down -v, then anything compose left behind: the teardown of a test that may have failed."""
        try:
            self.compose("down", "-v", "-t", "10", timeout=300)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        for _ in range(3):  # podman refuses to remove a container that another still requires: repeat
            for container in self.containers():
                podman("rm", "-f", "-t", "0", container["Id"], check=False)
        for volume in self.volumes():
            podman("volume", "rm", "-f", volume, check=False)
        for network in self.networks():
            podman("network", "rm", "-f", network, check=False)
