"""One `pdserve up` for one xPyD layout of a sweep: start it (pinned to its CPU cores or given its GPUs),
wait for its PDSERVE_READY line (the router routes to every engine by then) and for every engine's load figures,
then stop it cleanly (SIGINT, a bounded wait, then SIGKILL of its whole process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.sweep_layouts import Layout, cpu_plan, device_plan
from pdserve.cli_help import pins_cpus
from pdserve.bench.sweep_metrics import scrape_metrics

POLL_S = 0.2
STOP_TIMEOUT_S = 30.0
READY_PREFIX = "PDSERVE_READY role=up"


class ClusterError(RuntimeError):
    """`pdserve up` did not start (the message holds the end of its output)."""


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    device: str = "cpu"  # cpu or cuda
    pin_cpus: bool | None = None  # --pin-cpus as given: None pins where the engines fit the cores (pins_cpus)
    cores_per_engine: int = 1
    devices: list[str] | None = None  # GPU indices on cuda
    up_args: list[str] = field(default_factory=list)  # more `pdserve up` flags, as given
    api_key: str | None = None
    startup_timeout_s: float = 300.0
    dtype: str | None = None  # what the engines compute in, resolved (engines_dtype); None: not known


def engines_dtype(model: str, up_args: list[str], device: str) -> str | None:
    """The dtype a layout's engines compute in: up's --dtype (auto unless --up-args gives one) resolved for this
    model on this machine as the engines resolve it; None where the model directory has no config.json."""
    import json

    import torch

    from pdserve.cli_help import dtype_arg
    from pdserve.engine.config import choose_dtype

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    wanted = "auto"
    for index, word in enumerate(up_args):
        if word == "--dtype" and index + 1 < len(up_args):
            wanted = up_args[index + 1]
        elif word.startswith("--dtype="):
            wanted = word.split("=", 1)[1]
    try:
        torch_device = torch.device(device)
    except RuntimeError:  # not a device torch knows: run_sweep's device check refuses it with the fix
        return None
    hf = json.loads(config.read_text())
    dtype, _ = choose_dtype(dtype_arg(wanted), hf.get("torch_dtype") or hf.get("dtype"), torch_device)
    return str(dtype).removeprefix("torch.")


def up_command(spec: ClusterSpec, layout: Layout, log_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "pdserve", "up", "--model", spec.model, "--port", "0",
               "--log-dir", str(log_dir), "--device", spec.device]
    if layout.num_dual:
        command += ["--num-engines", str(layout.num_dual), "--adaptive"]
    else:
        command += ["--num-prefill", str(layout.num_prefill), "--num-decode", str(layout.num_decode)]
    if spec.device.startswith("cuda") and not layout.num_dual:
        prefill_gpus, decode_gpus = device_plan(layout, spec.devices)
        if prefill_gpus:
            command += ["--prefill-devices", ",".join(prefill_gpus)]
        command += ["--decode-devices", ",".join(decode_gpus)]
    else:  # resolved here, so `up` pins exactly when the sweep gave it the cores to
        command.append("--pin-cpus" if engine_cores(spec, layout) else "--no-pin-cpus")
    return command + spec.up_args


def engine_cores(spec: ClusterSpec, layout: Layout) -> list[int] | None:
    """The cores a layout's `pdserve up` is pinned to on CPU (cpu_plan), or None where it is not pinned."""
    if spec.device.startswith("cuda"):
        return None
    available = sorted(os.sched_getaffinity(0))
    if not pins_cpus(spec.pin_cpus, layout.num_engines * spec.cores_per_engine, len(available)):
        return None
    return cpu_plan(layout, available, spec.cores_per_engine)


class Cluster:
    """`with Cluster(spec, layout, log_dir) as cluster:` serves at cluster.url until the block ends."""

    def __init__(self, spec: ClusterSpec, layout: Layout, log_dir: Path) -> None:
        self.spec = spec
        self.layout = layout
        self.log_dir = log_dir
        self.output_path = log_dir / "up.out"
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.client_cores: list[int] | None = None  # cores left over for the benchmark client, if any

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = up_command(self.spec, self.layout, self.log_dir)
        cores = engine_cores(self.spec, self.layout)
        if cores:
            self.client_cores = [core for core in sorted(os.sched_getaffinity(0)) if core not in cores] or None
        env = {**os.environ, **({"PDSERVE_API_KEY": self.spec.api_key} if self.spec.api_key else {})}
        with open(self.output_path, "w") as output:
            # its own session: a Ctrl-C at the terminal reaches the sweep, which then stops `up` in order
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=_pin(cores))  # noqa: PLW1509 (no thread runs yet)
        where = f"cpu cores {','.join(map(str, cores))}" if cores else self.spec.device
        print(f"[pdserve sweep] {self.layout.name}: starting pdserve up on {where} (log {self.output_path})",
              flush=True)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        self.url = self._wait_ready_line(deadline)
        self._wait_engines(deadline)

    def _wait_ready_line(self, deadline: float) -> str:
        while True:
            for line in self.output_path.read_text(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    return dict(item.split("=", 1) for item in line.split()[1:])["url"]
            self._check_alive(deadline, "did not print its ready line")
            time.sleep(POLL_S)

    def _wait_engines(self, deadline: float) -> None:
        """Until /metrics has every engine's load figures (`up` is ready once the router routes to all of
        them; their first stats report may come a heartbeat later)."""
        while True:
            if self._engines_reporting() == self.layout.num_engines:
                return
            self._check_alive(deadline, f"does not route to all of {self.layout.name}'s engines")
            time.sleep(POLL_S)

    def _engines_reporting(self) -> int:
        try:
            samples = scrape_metrics(self.url, self.spec.api_key)
        except (OSError, ValueError):
            return 0
        return sum(1 for sample in samples if sample.name == "pdserve_kv_blocks_total")

    def _check_alive(self, deadline: float, what: str) -> None:
        if self.process.poll() is not None:
            raise ClusterError(f"pdserve up for {self.layout.name} exited with code {self.process.returncode}; "
                               f"its last lines ({self.output_path}):\n{self.output_tail()}")
        if time.monotonic() > deadline:
            raise ClusterError(f"pdserve up for {self.layout.name} {what} within {self.spec.startup_timeout_s:g}s "
                               f"(raise --startup-timeout); its last lines ({self.output_path}):\n{self.output_tail()}")

    def output_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.output_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no output)"

    def stop(self) -> None:
        """SIGINT (up stops its engines, then its router), a bounded wait, then SIGKILL to the whole group."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"[pdserve sweep] {self.layout.name}: pdserve up did not stop within {STOP_TIMEOUT_S:g}s: killing it",
                  file=sys.stderr, flush=True)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def _pin(cores: list[int] | None):
    if not cores:
        return None

    def pin() -> None:  # before exec: `up` and what it starts see only these cores
        os.sched_setaffinity(0, cores)
    return pin
