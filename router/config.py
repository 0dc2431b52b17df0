"""Everything one router process is configured with, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_POLICIES = ("round_robin", "least_loaded", "prefix_aware")
DECODE_POLICIES = ("round_robin", "least_kv")
ROUTINGS = ("static", "adaptive")  # static: the prefill and decode policies; adaptive: router/adaptive.py
TOOL_CALL_PARSERS = ("hermes",)  # formats of a model's own tool calls the router reads (router/tool_calls.py)


@dataclass(frozen=True)
class RouterConfig:
    model: str  # model directory or hub id: the tokenizer and chat template come from it
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (printed in the PDSERVE_READY line)
    api_key: str | None = None
    registration_address: str | None = "tcp://127.0.0.1:0"  # None: static engines only
    prefill_addresses: tuple[str, ...] = ()  # static engines: control addresses
    decode_addresses: tuple[str, ...] = ()
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_kv"
    local_prefill_threshold: int = 0  # uncached prompt tokens <= this: prefill on the decode engine
    routing: str = "static"  # static: prefill_policy and decode_policy; adaptive: router/adaptive_policy.py
    slo_ttft_ms: float = 2000.0  # the SLOs the adaptive policy routes for (--slo ttft:MS tpot:MS)
    slo_tpot_ms: float = 150.0
    step_profile: str | None = None  # a `pdserve profile` JSON: the adaptive policy's step model (None: built-in)
    adaptive_lean_interval_s: float = 1.0  # the adaptive policy's lean loop period; 0: no lean
    heartbeat_timeout_s: float = 3.0  # an engine silent this long leaves routing
    stats_interval_s: float = 1.0  # how often static engines are polled for stats
    max_concurrent_requests: int = 1024  # more in flight: 429
    max_retries: int = 2  # re-submissions of a request whose engine died before it streamed a token
    request_timeout_s: float = 600.0
    migration_timeout_s: float = 15.0  # a stream whose decode engine was lost waits this long for another; 0: off
    max_request_bytes: int = 4 << 20  # larger HTTP bodies: 413, refused before they are read whole
    max_body_bytes_in_flight: int = 32 << 20  # request bodies parsed and served at once (router/body_budget.py)
    body_budget_wait_s: float = 2.0  # a request that finds no room waits this long, then a 503
    preprocess_timeout_s: float = 5.0  # chat template + tokenization of one request, off the event loop
    num_preprocess_threads: int = 4  # tokenizer threads; more jobs wait for one (503 after 6 x the timeout)
    allow_request_chat_template: bool = False  # a `chat_template` in the request body replaces the model's
    chat_template: str | None = None  # the operator's template (--chat-template, its text): replaces the model's
    tool_call_parser: str | None = None  # serves tool_choice "auto" by reading the model's calls; None: "auto" is a 400
    max_n: int = 16  # choices (n x prompts) one HTTP request may ask for
    log_level: str = "info"
    curve_dir: str | None = None  # `pdserve keygen` directory: CURVE on the engine links and registration

    def __post_init__(self) -> None:
        checks = [
            (self.prefill_policy in PREFILL_POLICIES,
             f"prefill policy {self.prefill_policy!r} is unknown: use one of {', '.join(PREFILL_POLICIES)}"),
            (self.decode_policy in DECODE_POLICIES,
             f"decode policy {self.decode_policy!r} is unknown: use one of {', '.join(DECODE_POLICIES)}"),
            (self.routing in ROUTINGS, f"routing {self.routing!r} is unknown: use one of {', '.join(ROUTINGS)}"),
            (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0,
             f"SLOs ttft:{self.slo_ttft_ms:g} tpot:{self.slo_tpot_ms:g} must be > 0 milliseconds"),
            (self.adaptive_lean_interval_s >= 0,
             f"adaptive lean interval {self.adaptive_lean_interval_s} must be >= 0 seconds (0 turns the lean off)"),
            (self.local_prefill_threshold >= 0,
             f"local prefill threshold {self.local_prefill_threshold} must be >= 0 tokens"),
            (self.heartbeat_timeout_s > 0, f"heartbeat timeout {self.heartbeat_timeout_s} must be > 0 seconds"),
            (self.stats_interval_s > 0, f"stats interval {self.stats_interval_s} must be > 0 seconds"),
            (self.max_concurrent_requests > 0,
             f"max concurrent requests {self.max_concurrent_requests} must be a positive count"),
            (self.max_request_bytes > 0, f"max request bytes {self.max_request_bytes} must be a positive size"),
            (self.max_body_bytes_in_flight > 0,
             f"max body bytes in flight {self.max_body_bytes_in_flight} must be a positive size"),
            (self.preprocess_timeout_s > 0,
             f"preprocess timeout {self.preprocess_timeout_s} must be > 0 seconds"),
            (self.num_preprocess_threads > 0,
             f"preprocess threads {self.num_preprocess_threads} must be a positive count"),
            (self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
             f"tool-call parser {self.tool_call_parser!r} is unknown: use one of {', '.join(TOOL_CALL_PARSERS)}"),
            (self.max_retries >= 0, f"max retries {self.max_retries} must be >= 0"),
            (self.request_timeout_s > 0, f"request timeout {self.request_timeout_s} must be > 0 seconds"),
            (self.migration_timeout_s >= 0,
             f"migration timeout {self.migration_timeout_s} must be >= 0 seconds (0 turns migration off)"),
            (0 <= self.port < 65536, f"port {self.port} must be in 0..65535 (0 picks a free port)"),
            (self.registration_address is not None or self.decode_addresses,
             "the router can reach no decode engine: give --decode-address addresses or a --registration-address"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def open_api_warning(host: str, port: int, api_key: str | None) -> str | None:
    """What to warn of when the HTTP API has no key on an address other machines (or containers) can reach."""
    from pdserve.control.heartbeat import is_loopback_host

    if api_key or is_loopback_host(host.strip("[]")):
        return None
    return (f"no API key and HTTP on {host or 'every interface'}: any client that reaches port {port} can use the "
            "model; set --api-key or PDSERVE_API_KEY (or --host 127.0.0.1)")
