"""`pdserve router`: the OpenAI-compatible HTTP router alone (engines register with it, or are given)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdserve.cli_help import DeprecatedFlag
from pdserve.trust import add_trust_args, check_cluster_keys, curve_dir_for

DEMO_MODEL_NAME = "pdserve-demo"
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def add_router_args(parser: argparse.ArgumentParser, *, standalone: bool = True) -> None:
    """Router options; `pdserve up` shares them (standalone=False leaves out the engine addresses)."""
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the --model argument, or pdserve-demo)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 (default: env PDSERVE_API_KEY)")
    parser.add_argument("--prefill-policy", default="prefix_aware",
                        choices=["round_robin", "least_loaded", "prefix_aware"],
                        help="how a prefill engine is picked: in turn, fewest tokens queued, or most of the prompt "
                             "already in its prefix cache")
    parser.add_argument("--decode-policy", default="least_kv", choices=["round_robin", "least_kv"],
                        help="how a decode engine is picked: in turn, or most free KV blocks (prompts queued on "
                             "it count as used)")
    parser.add_argument("--local-prefill-threshold", type=int, default=0,
                        help="prefill on the decode engine when the prompt's uncached part is at most this "
                             "many tokens (conditional disaggregation)")
    parser.add_argument("--routing", default="static", choices=["static", "adaptive"],
                        help="static: the prefill and decode policies above; adaptive: per request, the (prefill, "
                             "decode) engine pair (one engine for both: colocated) that the step model predicts best "
                             "meets --slo, from each engine's load (docs/design/adaptive.md)")
    parser.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                        help="with --routing adaptive: the SLOs it routes for, e.g. ttft:2000 tpot:150 (the default)")
    parser.add_argument("--step-profile", default=None, metavar="P.json",
                        help="with --routing adaptive: a `pdserve profile` JSON whose step-time fits it predicts with "
                             "(default: built-in figures of the demo model on a 2-core CPU)")
    parser.add_argument("--adaptive-lean-interval", type=float, default=1.0, metavar="S",
                        help="with --routing adaptive: every S seconds (default 1) the step model judges the prompts "
                             "of the last 8 s and turns one more (or one fewer) dual-role engine to lean to prefill, "
                             "taking prompts and no new decodes; 0: no lean (docs/design/adaptive.md)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0,
                        help="seconds without news from an engine before it leaves routing")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="requests in flight beyond which the router answers 429")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--migration-timeout", type=float, default=15.0,
                        help="seconds a stream whose decode engine died or stopped beating waits for another decode "
                             "engine (or the restarted one) to go on with it; then it ends with an error (0: no "
                             "migration)")
    parser.add_argument("--max-request-bytes", type=int, default=4 << 20,
                        help="largest HTTP request body in bytes; larger ones get 413 (default 4 MiB)")
    parser.add_argument("--preprocess-timeout", type=float, default=5.0,
                        help="seconds the chat template and tokenizer may take for one request (then 400); a request "
                             "waits up to 6x this for a tokenizer thread (then 503)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file (or the template itself) used instead of the model's, e.g. "
                             "for a model that has none (vLLM's --chat-template; default: the model's own)")
    parser.add_argument("--allow-request-chat-template", action="store_true",
                        help="accept a `chat_template` in the request body (a template is code: it renders in a worker "
                             "process killed at the time limit)")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                        help="serve tool_choice \"auto\" (and tools without tool_choice) by reading the model's own "
                             "tool calls from its output: hermes = <tool_call>{\"name\": ..., \"arguments\": ...}"
                             "</tool_call> (Qwen2.5/Qwen3, Hermes); without it \"auto\" is refused (vLLM's "
                             "--enable-auto-tool-choice --tool-call-parser; default: none)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice 'auto' is served whenever "
                             "--tool-call-parser is given, which this flag needs")
    add_trust_args(parser, up=not standalone)
    if standalone:
        parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, type=str.lower,
                            help="least severe log messages shown")
        parser.add_argument("--registration-address", default="tcp://127.0.0.1:7000",
                            help="where engines register (their --router-address); 'none' to take static "
                                 "engines only")
        parser.add_argument("--prefill-address", action="append", default=[], metavar="ADDRESS",
                            help="control address of a prefill engine started without --router-address "
                                 "(repeatable; default: none, engines register with --registration-address); its KV address is asked")
        parser.add_argument("--decode-address", action="append", default=[], metavar="ADDRESS",
                            help="control address of a decode engine started without --router-address (repeatable; "
                                 "default: none)")
        for old, new in (("--prefill", "--prefill-address"), ("--decode", "--decode-address")):
            parser.add_argument(old, action=DeprecatedFlag, dest=new[2:].replace("-", "_"), replacement=new,
                                append=True)
        parser.add_argument("--stats-interval", type=float, default=1.0,
                            help="seconds between stats polls of static engines")
        parser.add_argument("--max-retries", type=int, default=2,
                            help="re-submissions of a request whose engine died before it streamed a token")


def resolve_model(model: str | None) -> tuple[str, str]:
    """(model path or hub id, default served name); no model = the built-in demo model."""
    if model:
        return model, model
    from pdserve.demo_model import default_demo_model

    return str(default_demo_model()), DEMO_MODEL_NAME


def router_config(args: argparse.Namespace):
    from pdserve.router.config import RouterConfig

    chat_template = check_router_flags(args)
    model, name = resolve_model(args.model)
    registration = None if str(args.registration_address).lower() == "none" else args.registration_address
    curve_dir = curve_dir_for(args, [registration, *args.prefill_address, *args.decode_address])
    return RouterConfig(
        model=model, served_model_name=args.served_model_name or name, host=args.host, port=args.port,
        api_key=args.api_key or None, registration_address=registration,
        prefill_addresses=tuple(args.prefill_address), decode_addresses=tuple(args.decode_address),
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        local_prefill_threshold=args.local_prefill_threshold, heartbeat_timeout_s=args.heartbeat_timeout,
        **routing_settings(args),
        stats_interval_s=args.stats_interval, max_concurrent_requests=args.max_concurrent_requests,
        max_retries=args.max_retries, request_timeout_s=args.request_timeout, log_level=args.log_level,
        migration_timeout_s=args.migration_timeout,
        max_request_bytes=args.max_request_bytes, preprocess_timeout_s=args.preprocess_timeout,
        allow_request_chat_template=args.allow_request_chat_template, tool_call_parser=args.tool_call_parser,
        chat_template=chat_template,
        curve_dir=curve_dir)


def parse_router_slos(items: list[str] | None) -> dict[str, float]:
    """--slo's ["ttft:2000", "tpot:150"] -> {"ttft": 2000.0, "tpot": 150.0}; a ValueError naming the item."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, text = item.partition(":")
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if name.strip().lower() not in ("ttft", "tpot") or not 0 < value < float("inf"):
            raise ValueError(f"--slo {item!r}: give METRIC:MILLISECONDS with METRIC ttft or tpot and a positive number, "
                             "e.g. --slo ttft:2000 tpot:150")
        slos[name.strip().lower()] = value
    return slos


def routing_settings(args: argparse.Namespace) -> dict:
    """RouterConfig's routing fields from --routing, --slo, --step-profile and --adaptive-lean-interval."""
    slos = parse_router_slos(args.slo)
    settings = {"routing": args.routing, "step_profile": args.step_profile,
                "adaptive_lean_interval_s": args.adaptive_lean_interval}
    settings.update({f"slo_{name}_ms": value for name, value in slos.items()})
    if args.step_profile:
        from pdserve.router.step_model import load_step_model

        load_step_model(args.step_profile)  # refused now, with the reason, rather than when the router starts
    return settings


def check_router_flags(args: argparse.Namespace) -> str | None:
    """The router's flags that it would refuse at start, checked (by `pdserve up` too, before it starts anything);
    the --chat-template text."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: add --tool-call-parser hermes (the "
                         "format of Qwen2.5/Qwen3 and Hermes models), the one parser this server has")
    check_router_numbers(args)
    routing_settings(args)  # --slo and --step-profile
    return read_chat_template(args.chat_template)


# RouterConfig's fields that `pdserve router` and `pdserve up` both take, by flag
SHARED_NUMBERS = {"local_prefill_threshold": "local_prefill_threshold", "heartbeat_timeout": "heartbeat_timeout_s",
                  "max_concurrent_requests": "max_concurrent_requests", "request_timeout": "request_timeout_s",
                  "max_request_bytes": "max_request_bytes", "preprocess_timeout": "preprocess_timeout_s",
                  "migration_timeout": "migration_timeout_s", "adaptive_lean_interval": "adaptive_lean_interval_s",
                  "port": "port"}


def check_router_numbers(args: argparse.Namespace) -> None:
    """RouterConfig's own range checks on the flags' values, one flag at a time, without the model or the addresses."""
    from pdserve.router.config import RouterConfig

    for flag, field in SHARED_NUMBERS.items():
        if hasattr(args, flag):
            try:
                RouterConfig(model="-", served_model_name="-", **{field: getattr(args, flag)})
            except ValueError as exc:
                raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None


def read_chat_template(given: str | None) -> str | None:
    """--chat-template's text: a file's, or the argument itself when it is a template (it holds Jinja's braces or a
    newline, as vLLM reads it); a ValueError naming the problem when it is neither or does not parse."""
    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {given}: cannot read it ({exc}): give a readable UTF-8 text file") from None
    elif any(char in given for char in "{}\n"):
        text = given
    else:
        raise ValueError(f"--chat-template {given}: no such file: give a Jinja template file, or the template itself")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {given}: not a Jinja template ({exc.message}, line {exc.lineno}): fix the "
                         "template") from None
    return text


def run_router(args: argparse.Namespace) -> int:
    from pdserve.router.server import run

    config = router_config(args)
    check_cluster_keys(config.curve_dir)
    return run(config)
