"""`pdserve up`: a router plus prefill and decode engines on this machine, as supervised processes (or, with
--adaptive, --num-engines dual-role engines and the router's adaptive policy).

Start order: the router, then, as soon as its PDSERVE_REGISTRATION line names the registration address
(before it loads the tokenizer), every engine at once (`python -m pdserve prefill|decode --router-address
...`); each is waited for by its own PDSERVE_READY line (the router's first: a failure it reports is
reported before an engine's), then until the router routes to all of them. One progress line per component.
A component that dies at start makes `up` stop the rest and exit non-zero with its last log lines;
once serving, pdserve.supervisor restarts what exits or stops making progress (docs/serving/supervision.md).
Ctrl-C / SIGTERM stops engines then the router, each within a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.cli_help import DeprecatedFlag, add_pin_cpus_arg, pins_cpus
from pdserve.router.config import open_api_warning
from pdserve.router_cli import LOG_LEVELS, check_router_flags, resolve_model
from pdserve.supervisor import Component, ComponentFailed, RestartPolicy, Supervisor, full_disk_note, log_tail
from pdserve.trust import check_cluster_keys, curve_dir_for, default_cluster_keys

KEPT_LOG_DIRS = 10


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefill", type=int, default=1, metavar="N",
                        help="prefill engines (0 = colocated: decode engines prefill themselves)")
    parser.add_argument("--num-decode", type=int, default=1, metavar="M", help="decode engines (at least 1)")
    parser.add_argument("--adaptive", action="store_true",
                        help="dual-role engines (`pdserve engine`, --num-engines of them) instead of fixed prefill and "
                             "decode ones, and the router's adaptive policy (--routing adaptive): the prefill:decode "
                             "split is chosen per request from live load (docs/design/adaptive.md); "
                             "--num-prefill and --num-decode are not used")
    parser.add_argument("--num-engines", type=int, default=None, metavar="N",
                        help="with --adaptive: dual-role engines to start (default 2)")
    for old, new in (("--prefill", "--num-prefill"), ("--decode", "--num-decode")):
        parser.add_argument(old, type=int, action=DeprecatedFlag, dest=new[2:].replace("-", "_"), replacement=new)
    parser.add_argument("--prefill-devices", default=None,
                        help="with --device cuda: comma-separated GPU indices for prefill engines (default 0..N-1)")
    parser.add_argument("--decode-devices", default=None,
                        help="with --device cuda: GPU indices for decode engines (default: the next M GPUs)")
    add_pin_cpus_arg(parser)
    parser.add_argument("--log-dir", default=None,
                        help="where each component's log file goes (default: a new up-<time> folder under "
                             "~/.cache/pdserve/logs, or $PDSERVE_CACHE/logs; the last 10 are kept)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="least severe log messages the components write")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds every component together may take to become ready")
    parser.add_argument("--max-restarts", type=int, default=5, metavar="N",
                        help="restarts per component within --restart-window; past it an engine is given up "
                             "and the router restarted on at the capped backoff (0 = never restart)")
    parser.add_argument("--restart-window", type=float, default=600.0, metavar="S",
                        help="seconds over which --max-restarts is counted")
    parser.add_argument("--registration-address", default="tcp://127.0.0.1:0", metavar="ADDRESS",
                        help="where the router takes engine registrations (port 0 = any free port)")
    parser.add_argument("--engine-host", default="127.0.0.1",
                        help="host the engines bind their control and KV sockets on (0.0.0.0: every interface, "
                             "CURVE only)")
    parser.add_argument("--engine-port-base", type=int, default=None, metavar="PORT",
                        help="pin the engines' ports for firewalls and containers: engine i (prefill engines "
                             "first) binds control on PORT+2i and KV on PORT+2i+1; restarts keep them "
                             "(default: any free ports)")
    parser.add_argument("--stall-timeout", type=float, default=120.0, metavar="S",
                        help="an engine whose loop makes no progress this long is killed and restarted "
                             "(0 = never); longer than the slowest step (a long prefill on CPU)")


# ---- the plan: which processes, with which arguments ----

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


def cpu_threads_each(num_cores: int, num_engines: int) -> int | None:
    """Torch threads per engine on CPU without --pin-cpus: with three engines or more, the cores shared out (at
    least one each); with one or two, torch's default of a thread per core (None). Engines of a disaggregated
    stack compute at the same time: 1P2D on 2 cores, each engine with 2 threads, ran 2 concurrent requests in
    10.1 s against 0.45 s pinned. For 1P1D on 2 cores the default is a trade: one request at a time 1.5x faster,
    8 concurrent ones 1.5x slower than with a thread each (docs/results.md, "CPU threads and a full KV pool")."""
    return max(1, num_cores // num_engines) if num_engines > 2 else None


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
    return command + trust_flags(args)


def trust_flags(args: argparse.Namespace) -> list[str]:
    """What every component is told: the cluster keys (run_up resolved them), or --insecure."""
    return ["--curve-dir", str(args.curve_dir)] if args.curve_dir else ["--insecure"]


def resolve_keys(args: argparse.Namespace) -> None:
    """CURVE on every plane unless --insecure: --curve-dir, or keys made on first start. --insecure is
    refused when --registration-address or --engine-host reach beyond loopback."""
    if not args.insecure and not args.curve_dir:
        args.curve_dir = str(default_cluster_keys())
    planes = [args.registration_address, f"tcp://{args.engine_host}:0"]
    args.curve_dir = curve_dir_for(args, planes)  # refuses both flags at once; warns under --insecure


def router_component(args: argparse.Namespace, model: str, name: str) -> Component:
    command = [sys.executable, "-m", "pdserve", "router", "--model", model, "--served-model-name", name,
               "--host", args.host, "--port", str(args.port), "--registration-address", args.registration_address,
               "--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy,
               "--local-prefill-threshold", str(args.local_prefill_threshold),
               "--routing", "adaptive" if args.adaptive else args.routing,
               "--adaptive-lean-interval", str(args.adaptive_lean_interval),
               "--heartbeat-timeout", str(args.heartbeat_timeout),
               "--max-concurrent-requests", str(args.max_concurrent_requests),
               "--request-timeout", str(args.request_timeout), "--log-level", args.log_level,
               "--migration-timeout", str(args.migration_timeout),
               "--max-request-bytes", str(args.max_request_bytes), "--preprocess-timeout", str(args.preprocess_timeout),
               *trust_flags(args)]
    if args.slo:
        command += ["--slo", *args.slo]
    if args.step_profile:
        command += ["--step-profile", args.step_profile]
    if args.chat_template is not None:
        command += ["--chat-template", args.chat_template]
    if args.allow_request_chat_template:
        command.append("--allow-request-chat-template")
    if args.tool_call_parser:
        command += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice:  # the router refuses it without --tool-call-parser, naming the fix
        command.append("--enable-auto-tool-choice")
    env = {"PDSERVE_API_KEY": args.api_key} if args.api_key else {}  # not on the command line, where ps shows it
    return Component("router", command, env)


def engine_roles(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """Each engine's command (prefill, decode, or engine: dual-role) and its index among those of its command."""
    if args.adaptive:
        return ["engine"] * args.num_engines, list(range(args.num_engines))
    return (["prefill"] * args.num_prefill + ["decode"] * args.num_decode,
            list(range(args.num_prefill)) + list(range(args.num_decode)))


def engine_components(args: argparse.Namespace, model: str, registration: str) -> list[Component]:
    roles, indexes = engine_roles(args)
    cuda = args.device.startswith("cuda")
    if args.adaptive:
        gpus = _devices(args.decode_devices or args.prefill_devices, len(roles), 0) if cuda else []
    else:
        gpus = (_devices(args.prefill_devices, args.num_prefill, 0)
                + _devices(args.decode_devices, args.num_decode, args.num_prefill) if cuda else [])
    cores = sorted(os.sched_getaffinity(0))
    pinned = not cuda and pins_cpus(args.pin_cpus, len(roles), len(cores))
    cpu_sets = split_cpus(cores, len(roles)) if pinned else None
    shared_threads = cpu_threads_each(len(cores), len(roles))
    components = []
    for position, (role, index) in enumerate(zip(roles, indexes)):
        engine_id = f"{role}-{index}"
        command = [sys.executable, "-m", "pdserve", role, *_engine_model_args(args, model), "--engine-id", engine_id,
                   "--router-address", registration, "--device", "cuda" if cuda else args.device,
                   "--log-level", args.log_level.upper(), *engine_addresses(args, role, position)]
        component = Component(engine_id, command)
        if cuda:
            component.env["CUDA_VISIBLE_DEVICES"] = gpus[position]
            component.where = f"GPU {gpus[position]}"
        elif cpu_sets is not None:
            component.cpus = cpu_sets[position]
            component.env["OMP_NUM_THREADS"] = str(len(cpu_sets[position]))
            component.where = f"cpu cores {','.join(map(str, cpu_sets[position]))}"
        elif shared_threads is None or "OMP_NUM_THREADS" in os.environ:  # torch's default, or the operator's own
            component.where = "cpu"
        else:
            component.env["OMP_NUM_THREADS"] = str(shared_threads)
            component.where = f"cpu, {shared_threads} thread"
        components.append(component)
    return components


def engine_addresses(args: argparse.Namespace, role: str, position: int) -> list[str]:
    """The control (and, for prefill and dual-role engines, KV) addresses of the engine at `position` in the plan."""
    host = args.engine_host
    if args.engine_port_base is None:
        ports = (0, 0)
    else:
        ports = (args.engine_port_base + 2 * position, args.engine_port_base + 2 * position + 1)
    addresses = ["--control-address", f"tcp://{host}:{ports[0]}"]
    if role in ("prefill", "engine"):
        addresses += ["--kv-address", f"tcp://{host}:{ports[1]}"]
    return addresses


def check_ports(args: argparse.Namespace) -> None:
    if args.engine_port_base is None:
        return
    num_engines = len(engine_roles(args)[0])
    last = args.engine_port_base + 2 * num_engines - 1
    if args.engine_port_base < 1 or last > 65535:
        raise ValueError(f"--engine-port-base {args.engine_port_base}: the {num_engines} engines need "
                         f"ports {args.engine_port_base}..{last}; give a base between 1 and {65536 - 2 * num_engines}")


# ---- running them ----

def wait_routed(supervisor: Supervisor, url: str, num_prefill: int, num_decode: int, deadline: float,
                router: Component) -> None:
    """Until the router routes to every engine (its /health counts them)."""
    while True:
        engines = _health_engines(url)
        if engines == {"prefill": num_prefill, "decode": num_decode}:
            return
        supervisor.tick(deadline, f"does not route to all engines (it sees {engines})", router)


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


def _check_engines(args: argparse.Namespace) -> None:
    if args.device != "cpu":  # each engine would refuse it after the router started
        from pdserve.engine.config import check_device

        check_device(args.device)
    if args.num_engines is not None and not args.adaptive:
        raise ValueError(f"--num-engines {args.num_engines} starts dual-role engines for the adaptive policy: add "
                         "--adaptive, or give --num-prefill and --num-decode for fixed roles")
    if args.adaptive:
        args.num_engines = 2 if args.num_engines is None else args.num_engines
        if args.num_engines < 1:
            raise ValueError(f"--num-engines {args.num_engines}: at least one dual-role engine is needed")
        args.num_prefill = args.num_decode = args.num_engines  # every dual-role engine is in both pools
        return
    if args.num_prefill < 0:
        raise ValueError(f"--num-prefill {args.num_prefill}: give 0 or more prefill engines")
    if args.num_decode < 1:
        raise ValueError(f"--num-decode {args.num_decode}: at least one decode engine is needed")


def new_log_dir(keep: int = KEPT_LOG_DIRS) -> Path:
    """A fresh up-<UTC time> folder under the pdserve cache's logs/; only the newest `keep` are kept."""
    from pdserve.demo_model import cache_dir

    root = cache_dir() / "logs"
    root.mkdir(parents=True, exist_ok=True)
    now_ns = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now_ns // 10**9)) + f".{now_ns % 10**9:09d}"
    log_dir = Path(tempfile.mkdtemp(dir=root, prefix=f"up-{stamp}-"))
    # by name, which starts with the creation time to the nanosecond (directory mtimes can tie within a
    # clock tick); the folder just made is never among those pruned
    older = sorted(path for path in root.glob("up-*") if path != log_dir)
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return log_dir


def lock_log_dir(log_dir: Path):
    """An exclusive lock on `log_dir` while this `up` runs (the open lock file; closing it unlocks): a second `up`
    given the same --log-dir would overwrite the first's logs and share its engines' progress files, so that its
    supervisor took one stack's engines for the other's."""
    import fcntl

    handle = open(log_dir / "up.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise ValueError(f"--log-dir {log_dir} is in use by another `pdserve up` (pid {owner}): give each its own "
                         f"--log-dir, or leave it out (each run gets a new folder)") from None
    try:  # unbuffered: on a full disk the lock holds without the pid
        os.ftruncate(handle.fileno(), 0)
        os.write(handle.fileno(), f"{os.getpid()}\n".encode())
    except OSError:
        pass
    return handle


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    if args.max_restarts < 0 or args.restart_window <= 0 or args.stall_timeout < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}, --restart-window {args.restart_window:g}, "
                         f"--stall-timeout {args.stall_timeout:g}: give counts and seconds >= 0 (a window > 0)")
    if not args.startup_timeout > 0:
        raise ValueError(f"--startup-timeout {args.startup_timeout:g}: give the seconds the components may take to "
                         f"start, above 0 (default 900)")
    return RestartPolicy(args.max_restarts, args.restart_window, args.stall_timeout, args.startup_timeout)


def pin_router_addresses(router: Component) -> None:
    """A restarted router must come back where engines and clients know it: the port and registration
    address the first one got (port 0 = whatever it was given)."""
    for flag, value in (("--port", router.ready["url"].rsplit(":", 1)[1]),
                        ("--registration-address", router.ready["registration"])):
        router.command[router.command.index(flag) + 1] = value


def watch_progress(engine: Component, log_dir: Path, stall_s: float) -> None:
    """The engine's loop touches a file the supervisor reads; its heartbeat stops when the loop stalls."""
    engine.progress_path = log_dir / f"{engine.name}.progress"
    engine.command += ["--progress-file", str(engine.progress_path), "--stall-timeout", f"{stall_s:g}"]


def wait_registration(supervisor: Supervisor, router: Component, deadline: float) -> str:
    """The registration address the router bound, from its PDSERVE_REGISTRATION line (printed before it loads
    the tokenizer) or its ready line."""
    while True:
        line = supervisor.find_line(router, "PDSERVE_REGISTRATION ") or supervisor.find_line(router, "PDSERVE_READY ")
        if line is not None and line.get("registration"):
            return line["registration"]
        supervisor.tick(deadline, "did not become ready", router, [router])


def _start_all(args: argparse.Namespace, supervisor: Supervisor, model: str, name: str, deadline: float) -> str:
    """Router, then engines once it has bound its registration address (they start while it loads the
    tokenizer), until the router routes to all of them; returns the router's URL."""
    router = router_component(args, model, name)
    supervisor.start(router)
    engines = engine_components(args, model, wait_registration(supervisor, router, deadline))
    for engine in engines:
        watch_progress(engine, supervisor.log_dir, args.stall_timeout)
        supervisor.start(engine)
    supervisor.wait_ready([router, *engines], deadline, first=router)
    pin_router_addresses(router)
    url = router.ready["url"]
    wait_routed(supervisor, url, args.num_prefill, args.num_decode, deadline, router)
    return url


def run_up(args: argparse.Namespace) -> int:
    _check_engines(args)
    check_router_flags(args)  # what the router would refuse once started: refused before anything starts
    check_ports(args)
    resolve_keys(args)
    check_cluster_keys(args.curve_dir)
    policy = restart_policy(args)
    model, default_name = resolve_model(args.model)
    name = args.served_model_name or default_name
    log_dir = Path(args.log_dir).expanduser() if args.log_dir else new_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    _log_dir_lock = lock_log_dir(log_dir)  # held until `up` returns
    engines = (f"{args.num_engines} dual-role engine(s) (adaptive routing)" if args.adaptive
               else f"{args.num_prefill} prefill + {args.num_decode} decode engine(s)")
    print(f"[pdserve up] serving {name} with {engines}; logs in {log_dir}", flush=True)
    print(f"[pdserve up] {'CURVE keys in ' + args.curve_dir if args.curve_dir else 'warning: --insecure: no CURVE'}"
          f" on {'every' if args.curve_dir else 'any'} plane", flush=True)
    open_api = open_api_warning(args.host, args.port, args.api_key)
    if open_api:
        print(f"[pdserve up] warning: {open_api}", flush=True)
    supervisor = Supervisor(log_dir, policy)

    def on_signal(*_: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = _start_all(args, supervisor, model, name, time.monotonic() + args.startup_timeout)
        dual = f" dual={args.num_engines}" if args.adaptive else ""
        print(f"PDSERVE_READY role=up url={url} prefill={args.num_prefill} decode={args.num_decode}{dual}", flush=True)
        print(f"[pdserve up] ready: OpenAI API at {url}/v1 (model {name!r}); Ctrl-C stops", flush=True)
        supervisor.watch()
        return 0
    except KeyboardInterrupt:
        return 0
    except ComponentFailed as exc:
        print(f"[pdserve up] error: {exc}{full_disk_note(log_dir)}; its last log lines ({exc.component.log_path}):\n"
              f"{log_tail(exc.component.log_path)}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("[pdserve up] stopping", flush=True)
        supervisor.stop_all()
        print("[pdserve up] stopped", flush=True)
