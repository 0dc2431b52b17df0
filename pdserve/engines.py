"""`pdserve prefill`, `pdserve decode` and `pdserve engine` (either role per request, the "dual" role):
build one engine service from arguments and run it.

When ready, each prints one line on stdout that launchers and tests wait for:
    PDSERVE_READY role=<role> engine_id=<id> control=<address> [kv=<address>]
"""

from __future__ import annotations

import argparse
import logging
import socket

from pdserve.trust import add_trust_args, check_cluster_keys, curve_dir_for


def add_engine_args(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--control-address", default="tcp://127.0.0.1:0",
                        help="where the router reaches this engine (tcp://host:port or ipc://path; port 0 = any)")
    parser.add_argument("--engine-id", default=None,
                        help=f"this engine's name in the router's metrics and logs; unique per engine "
                             f"(default: {role}-HOSTNAME, so container replicas differ)")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="least severe log messages shown")
    parser.add_argument("--router-address", action="append", default=[], metavar="ADDRESS",
                        help="register with the router at this address (its --registration-address, e.g. "
                             "tcp://router:7000) and heartbeat load figures to it; repeat it for every router "
                             "replica serving this engine (docs/serving/deploy.md; default: none, the router dials the engine)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="stop heartbeating when the engine loop made no progress for this many seconds, so "
                             "the router stops routing to a stuck engine (0 = never)")
    parser.add_argument("--progress-file", default=None,
                        help="touch this file as the engine loop goes round (for a supervisor such as `pdserve up`; "
                             "default: none)")
    add_trust_args(parser)
    parser.add_argument("--advertise-address", "--advertise-host", dest="advertise_host", default=None,
                        metavar="HOST",
                        help="host name or IP routers and peers reach this engine at (e.g. a pod IP); default: "
                             "the bind host, or for a wildcard bind (0.0.0.0) this host's IP on the route to "
                             "the router. A loopback address is refused when a router is elsewhere")
    if role in ("prefill", "dual"):
        add_kv_serving_args(parser)
    if role in ("decode", "dual"):
        add_kv_pulling_args(parser)


def add_kv_serving_args(parser: argparse.ArgumentParser) -> None:
    """The prefill role's KV options: where peers pull KV from, how long computed prompts wait for them."""
    parser.add_argument("--kv-address", default="tcp://127.0.0.1:0", help="where decode engines pull KV from")
    parser.add_argument("--kv-want-timeout", type=float, default=30.0,
                        help="seconds a finished prefill waits for a decode engine to ask for its KV, unless a "
                             "decode engine has said it has the request queued (then --kv-hold-timeout)")
    parser.add_argument("--kv-hold-timeout", type=float, default=600.0,
                        help="seconds a finished prefill that a decode engine has queued (its KV pool full) "
                             "waits for that engine to ask for its KV (the router's --request-timeout bounds "
                             "a request anyway)")
    parser.add_argument("--kv-lease", type=float, default=30.0,
                        help="seconds sent KV stays allocated without the decode engine's ack")
    parser.add_argument("--kv-streaming", choices=["auto", "on", "off"], default="auto",
                        help="send each layer's KV while the prompt computes (on) or all of it after (off); "
                             "auto: on with a CUDA --device, off on CPU, where the sending competes with the "
                             "prefill for the same cores (measured in docs/results.md)")


def add_kv_pulling_args(parser: argparse.ArgumentParser) -> None:
    """The decode role's KV options: which peers it pulls from, how long it waits for their KV."""
    parser.add_argument("--kv-timeout", type=float, default=30.0,
                        help="seconds to wait for a prompt's KV once the prefill engine has computed the prompt "
                             "(its first token came through the router); then recompute or fail (--kv-failure)")
    parser.add_argument("--kv-queue-timeout", type=float, default=600.0,
                        help="seconds to wait, from asking for a prompt's KV, for the prefill engine to compute "
                             "the prompt: its time in that engine's queue (the router's --request-timeout bounds "
                             "a request anyway)")
    parser.add_argument("--kv-failure", choices=["recompute", "fail"], default="recompute",
                        help="when remote KV does not arrive: prefill locally, or end the request with an error")
    parser.add_argument("--kv-peer", action="append", default=[], metavar="ADDRESS",
                        help="a prefill engine's KV address to pull from (repeatable). The prefill engines "
                             "registered with --router-address's router are trusted without it; a request "
                             "naming any other address is prefilled locally (default: only the registered ones)")


def _configs(args: argparse.Namespace) -> tuple:
    """(ModelConfig, CacheConfig, SchedulerConfig); torch is imported here, not at parse time."""
    from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig, check_device
    from pdserve.engine.loader import resolve_model_dir

    check_device(args.device)  # before building or fetching a model it could not run
    if args.model is None:
        from pdserve.demo_model import default_demo_model

        args.model = str(default_demo_model())
    model_config = ModelConfig.from_hf(resolve_model_dir(args.model), dtype=args.dtype, device=args.device,
                                       max_model_len=args.max_model_len, model_impl=args.model_impl,
                                       enforce_eager=args.enforce_eager)
    cache_config = CacheConfig(args.block_size, args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching)
    scheduler_config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
    return model_config, cache_config, scheduler_config


def streams_layers(choice: str, device: str) -> bool:
    """--kv-streaming: auto streams when the prefill computes on a GPU and the host cores are free."""
    return choice == "on" or (choice == "auto" and device.startswith("cuda"))


def default_engine_id(role: str) -> str:
    """role-hostname: a container's hostname is its id, so `--scale` replicas get distinct ids."""
    return f"{role}-{socket.gethostname()}"


def _prefill_options(args: argparse.Namespace, curve_dir: str | None):
    from pdserve.prefill.service import PrefillOptions

    return PrefillOptions(args.control_address, args.kv_address, args.engine_id, args.kv_want_timeout, args.kv_lease,
                          args.device, streams_layers(args.kv_streaming, args.device), curve_dir,
                          hold_timeout_s=args.kv_hold_timeout)


def _decode_options(args: argparse.Namespace, curve_dir: str | None):
    from pdserve.decode.service import DecodeOptions

    return DecodeOptions(args.control_address, args.engine_id, args.kv_timeout, args.kv_failure, args.device, curve_dir,
                         tuple(args.kv_peer), kv_queue_timeout_s=args.kv_queue_timeout)


def build_server(args: argparse.Namespace, role: str, curve_dir: str | None):
    """The engine service of `role` (prefill, decode or dual) from its command's arguments."""
    configs = _configs(args)
    if role == "prefill":
        from pdserve.prefill.service import build_prefill_server

        return build_prefill_server(*configs, _prefill_options(args, curve_dir))
    if role == "dual":
        from pdserve.dualrole.server import DualRoleOptions, build_dual_role_server

        options = DualRoleOptions(_prefill_options(args, curve_dir), _decode_options(args, curve_dir))
        return build_dual_role_server(*configs, options)
    from pdserve.decode.service import build_decode_server

    return build_decode_server(*configs, _decode_options(args, curve_dir))


def run_engine(args: argparse.Namespace, role: str) -> int:
    """role: prefill, decode, or dual (`pdserve engine`: either role per request)."""
    args.engine_id = args.engine_id or default_engine_id(role)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    curve_dir = curve_dir_for(args, [args.control_address, getattr(args, "kv_address", None), *args.router_address])
    check_cluster_keys(curve_dir)
    server = build_server(args, role, curve_dir)
    if role != "prefill" and not args.router_address and not args.kv_peer:
        logging.getLogger(f"pdserve.{role}").warning(
            "no --router-address and no --kv-peer: this engine trusts no prefill engine and prefills every "
            "prompt itself; give --router-address or the prefill engines' KV addresses with --kv-peer")
    server.install_signal_handlers()
    if args.progress_file:
        server.enable_progress_file(args.progress_file)
    if args.router_address:
        server.enable_registration(args.router_address, args.heartbeat_interval, args.advertise_host,
                                   args.stall_timeout or None)
    kv = f" kv={server.kv_address}" if role != "decode" else ""
    print(f"PDSERVE_READY role={role} engine_id={args.engine_id} control={server.control_address}{kv}", flush=True)
    server.run()
    return 0
