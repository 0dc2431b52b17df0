"""`pdserve up`: a router plus prefill and decode engines on this machine, as supervised processes.

Start order: the router (its PDSERVE_READY line names the registration address), then every engine
at once (`python -m pdserve prefill|decode --router-address ...`, each waited for by its own
PDSERVE_READY line), then until the router routes to all of them. One progress line per component.
Ctrl-C / SIGTERM stops engines then the router, each within a bound. A component that dies makes
`up` stop the rest and exit non-zero with that component's last log lines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.router_cli import resolve_model

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.1
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 30


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, metavar="N",
                        help="prefill engines (0 = colocated: decode engines prefill themselves)")
    parser.add_argument("--decode", type=int, default=1, metavar="M", help="decode engines (at least 1)")
    parser.add_argument("--prefill-devices", default=None,
                        help="with --device cuda: comma-separated GPU indices for prefill engines (default 0..N-1)")
    parser.add_argument("--decode-devices", default=None,
                        help="with --device cuda: GPU indices for decode engines (default: the next M GPUs)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="on CPU: give each engine its own cores (sched_setaffinity) and threads to match")
    parser.add_argument("--log-dir", default=None, help="where component logs go (default: a new temp dir)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds every component together may take to become ready")


# ---- the plan: which processes, with which arguments ----

@dataclass
class Component:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None  # CPU affinity, when pinned
    where: str = ""  # for the progress line
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    ready: dict[str, str] | None = None
    started_at: float = 0.0


def _devices(spec: str | None, count: int, first: int) -> list[str]:
    if spec is None:
        return [str(first + i) for i in range(count)]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError(f"device list {spec!r} is empty: give comma-separated GPU indices, e.g. 0,1")
    return [devices[i % len(devices)] for i in range(count)]


def split_cpus(cores: list[int], num_engines: int) -> list[list[int]]:
    """Disjoint core sets, one per engine (shared round-robin only when there are fewer cores)."""
    if num_engines <= len(cores):
        per_engine = len(cores) // num_engines
        return [cores[i * per_engine:(i + 1) * per_engine] for i in range(num_engines)]
    print(f"[pdserve up] warning: {num_engines} engines but {len(cores)} cores: engines share cores", flush=True)
    return [[cores[i % len(cores)]] for i in range(num_engines)]


def _engine_model_args(args: argparse.Namespace, model: str) -> list[str]:
    command = ["--model", model, "--dtype", args.dtype, "--block-size", str(args.block_size),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--model-impl", args.model_impl]
    if args.num_kv_blocks is not None:
        command += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        command.append("--no-prefix-caching")
    if getattr(args, "enforce_eager", False):
        command.append("--enforce-eager")
    if args.curve_dir:
        command += ["--curve-dir", args.curve_dir]
    return command


def router_component(args: argparse.Namespace, model: str, name: str) -> Component:
    command = [sys.executable, "-m", "pdserve", "router", "--model", model, "--served-model-name", name,
               "--host", args.host, "--port", str(args.port), "--registration-address", "tcp://127.0.0.1:0",
               "--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy,
               "--local-prefill-threshold", str(args.local_prefill_threshold),
               "--heartbeat-timeout", str(args.heartbeat_timeout),
               "--max-concurrent-requests", str(args.max_concurrent_requests),
               "--request-timeout", str(args.request_timeout), "--log-level", args.log_level,
               "--max-request-bytes", str(args.max_request_bytes), "--preprocess-timeout", str(args.preprocess_timeout)]
    if args.allow_request_chat_template:
        command.append("--allow-request-chat-template")
    if args.curve_dir:
        command += ["--curve-dir", args.curve_dir]
    env = {"PDSERVE_API_KEY": args.api_key} if args.api_key else {}  # not on the command line, where ps shows it
    return Component("router", command, env)


def engine_components(args: argparse.Namespace, model: str, registration: str) -> list[Component]:
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    indexes = list(range(args.prefill)) + list(range(args.decode))
    cuda = args.device.startswith("cuda")
    gpus = (_devices(args.prefill_devices, args.prefill, 0) + _devices(args.decode_devices, args.decode, args.prefill)
            if cuda else [])
    cpu_sets = split_cpus(sorted(os.sched_getaffinity(0)), len(roles)) if args.pin_cpus and not cuda else None
    components = []
    for position, (role, index) in enumerate(zip(roles, indexes)):
        engine_id = f"{role}-{index}"
        command = [sys.executable, "-m", "pdserve", role, *_engine_model_args(args, model), "--engine-id", engine_id,
                   "--router-address", registration, "--device", "cuda" if cuda else args.device,
                   "--log-level", args.log_level.upper()]
        component = Component(engine_id, command)
        if cuda:
            component.env["CUDA_VISIBLE_DEVICES"] = gpus[position]
            component.where = f"GPU {gpus[position]}"
        elif cpu_sets is not None:
            component.cpus = cpu_sets[position]
            component.env["OMP_NUM_THREADS"] = str(len(cpu_sets[position]))
            component.where = f"cpu cores {','.join(map(str, cpu_sets[position]))}"
        else:
            component.where = "cpu"
        components.append(component)
    return components


# ---- running them ----

def _child_setup(cpus: list[int] | None):
    """Runs in each child before exec: its CPU cores, and SIGTERM when `up` itself dies (even by SIGKILL)."""
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: children outlive a killed `up`
            pass
    return setup


class ComponentFailed(Exception):
    def __init__(self, component: Component, why: str) -> None:
        super().__init__(f"{component.name} {why}")
        self.component = component


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.components: list[Component] = []
        self.stopping = False

    def start(self, component: Component) -> None:
        component.log_path = self.log_dir / f"{component.name}.log"
        log_file = open(component.log_path, "w")
        component.process = subprocess.Popen(
            component.command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **component.env}, start_new_session=True,  # Ctrl-C reaches `up` only
            preexec_fn=_child_setup(component.cpus))
        log_file.close()
        component.started_at = time.monotonic()
        self.components.append(component)

    def check_alive(self) -> None:
        for component in self.components:
            code = component.process.poll()
            if code is not None:
                raise ComponentFailed(component, f"exited with code {code}")

    def poll_ready(self, component: Component) -> bool:
        if component.ready is None:
            for line in component.log_path.read_text(errors="replace").splitlines():
                if line.startswith("PDSERVE_READY "):
                    component.ready = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
                    break
        return component.ready is not None

    def wait_ready(self, components: list[Component], deadline: float) -> None:
        waiting = list(components)
        while waiting:
            self._tick(deadline, "did not become ready", waiting[0])
            for component in list(waiting):
                if self.poll_ready(component):
                    waiting.remove(component)
                    took = time.monotonic() - component.started_at
                    where = component.ready.get("url", component.where)
                    print(f"[pdserve up] {component.name} ready ({where}, pid {component.process.pid}, {took:.1f}s)",
                          flush=True)

    def _tick(self, deadline: float, why: str, component: Component) -> None:
        if self.stopping:
            raise KeyboardInterrupt
        self.check_alive()
        if time.monotonic() > deadline:
            raise ComponentFailed(component, f"{why} within --startup-timeout")
        time.sleep(POLL_S)

    def wait_routed(self, url: str, num_prefill: int, num_decode: int, deadline: float, router: Component) -> None:
        """Until the router routes to every engine (its /health counts them)."""
        while True:
            engines = _health_engines(url)
            if engines == {"prefill": num_prefill, "decode": num_decode}:
                return
            self._tick(deadline, f"does not route to all engines (it sees {engines})", router)

    def watch(self) -> None:
        """Serve until a signal. A dead engine is reported and left out (the router routes around it);
        a dead router ends `up`."""
        reported: set[str] = set()
        while not self.stopping:
            for component in self.components:
                code = component.process.poll()
                if code is None or component.name in reported:
                    continue
                if component.name == "router":
                    raise ComponentFailed(component, f"exited with code {code}")
                reported.add(component.name)
                print(f"[pdserve up] warning: {component.name} exited with code {code}; the router routes "
                      f"around it. Its last log lines ({component.log_path}):\n{log_tail(component.log_path, 10)}",
                      file=sys.stderr, flush=True)
            time.sleep(POLL_S * 5)

    def stop_all(self) -> None:
        """Engines first (they deregister), then the router; SIGKILL what outlives the bound."""
        engines = [c for c in self.components if c.name != "router"]
        routers = [c for c in self.components if c.name == "router"]
        for group in (engines, routers):
            for component in group:
                if component.process.poll() is None:
                    component.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for component in group:
                try:
                    component.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"[pdserve up] {component.name} did not stop within {STOP_TIMEOUT_S:.0f}s: killing it",
                          flush=True)
                    component.process.kill()
                    component.process.wait()


def _health_engines(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.loads(response.read()).get("engines")
    except urllib.error.HTTPError as exc:  # 503 until a decode engine is routable: still has the counts
        try:
            return json.loads(exc.read()).get("engines")
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def _check_counts(args: argparse.Namespace) -> None:
    if args.prefill < 0:
        raise ValueError(f"--prefill {args.prefill}: give 0 or more prefill engines")
    if args.decode < 1:
        raise ValueError(f"--decode {args.decode}: at least one decode engine is needed")


def run_up(args: argparse.Namespace) -> int:
    _check_counts(args)
    model, default_name = resolve_model(args.model)
    name = args.served_model_name or default_name
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[pdserve up] serving {name} with {args.prefill} prefill + {args.decode} decode engine(s); "
          f"logs in {log_dir}", flush=True)
    supervisor = Supervisor(log_dir)

    def on_signal(*_: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    deadline = time.monotonic() + args.startup_timeout
    try:
        router = router_component(args, model, name)
        supervisor.start(router)
        supervisor.wait_ready([router], deadline)
        url = router.ready["url"]
        engines = engine_components(args, model, router.ready["registration"])
        for engine in engines:
            supervisor.start(engine)
        supervisor.wait_ready(engines, deadline)
        supervisor.wait_routed(url, args.prefill, args.decode, deadline, router)
        print(f"PDSERVE_READY role=up url={url} prefill={args.prefill} decode={args.decode}", flush=True)
        print(f"[pdserve up] ready: OpenAI API at {url}/v1 (model {name!r}); Ctrl-C stops", flush=True)
        supervisor.watch()
        return 0
    except KeyboardInterrupt:
        return 0
    except ComponentFailed as exc:
        print(f"[pdserve up] error: {exc}; its last log lines ({exc.component.log_path}):\n"
              f"{log_tail(exc.component.log_path)}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("[pdserve up] stopping", flush=True)
        supervisor.stop_all()
        print("[pdserve up] stopped", flush=True)
