"""`pdserve sweep`'s command-line flags (argparse only, so building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse
import math

from pdserve.cli_help import add_pin_cpus_arg, seed_arg

# flags passed through to `pdserve bench` as they are, when given
DATASET_FLAGS = ("--dataset", "--dataset-path", "--input-len", "--output-len", "--range-ratio", "--endpoint",
                 "--burstiness", "--phases", "--phase-cycles")
DEFAULT_NUM_PROMPTS = 50
SCHEDULED_DATASETS = ("phased", "trace")  # bench's datasets that bring their own arrival times


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="*", default=["1P1D", "0P2D"], metavar="xPyD",
                        help="layouts of `pdserve up`: x prefill and y decode engines (0P = colocated), or "
                             "adaptive[:N]: N dual-role engines whose roles the router picks per request (N: the "
                             "largest static layout's engine count); none with --base-url: only the external servers")
    parser.add_argument("--base-url", action="append", default=[], metavar="NAME=URL",
                        help="an OpenAI-compatible server already running, benchmarked as one more row "
                             "(repeatable; default: none)")
    parser.add_argument("--request-rates", nargs="+", type=float, default=None, metavar="R",
                        help="requests per second (Poisson arrivals; inf = all at once; default: inf when only "
                             "--max-concurrencies is given)")
    parser.add_argument("--max-concurrencies", nargs="+", type=int, default=None, metavar="C",
                        help="caps on requests in flight (with --request-rates: every pair is run; default: no cap)")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the built-in demo model)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"requests per run (default {DEFAULT_NUM_PROMPTS}; phased, trace: the whole schedule)")
    parser.add_argument("--dataset", default=None,
                        help="bench's dataset: random, sharegpt, prefix, jsonl, phased or trace (default: bench's, "
                             "random)")
    parser.add_argument("--dataset-path", default=None,
                        help="bench's --dataset-path (sharegpt, jsonl, trace; default: none)")
    parser.add_argument("--phases", default=None, metavar="IN:OUT:RATE:SECONDS[:RATIO],...",
                        help="bench's --phases, with --dataset phased: a workload that shifts (default: none)")
    parser.add_argument("--phase-cycles", type=int, default=None, help="bench's --phase-cycles (default: bench's, 1)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="bench's --input-len: prompt tokens (default: bench's)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="bench's --output-len: max_tokens per request (default: bench's)")
    parser.add_argument("--range-ratio", type=float, default=None,
                        help="bench's --range-ratio: length spread (default: bench's)")
    parser.add_argument("--burstiness", type=float, default=None,
                        help="bench's --burstiness: gamma shape of arrival gaps (1 = Poisson; default: bench's)")
    parser.add_argument("--seed", type=seed_arg, default=0,
                        help="the n-th load of every server gets seed + n: the same prompts across servers, "
                             "new prompts (no prefix-cache hits from earlier runs) across loads")
    parser.add_argument("--endpoint", default=None, help="/v1/completions or /v1/chat/completions (default: bench's)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="exact output lengths (on by default)")
    parser.add_argument("--bench-args", default="", metavar="'ARGS'", help="more `pdserve bench` flags, one string")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 (also e2el): SLO attainment and goodput (default: none)")
    parser.add_argument("--slo-factors", nargs="+", default=None, metavar="METRIC:FACTOR",
                        help="SLOs from unloaded latencies measured first in this sweep, e.g. ttft:4 tpot:1.3: each "
                             "server serves --unloaded-prompts requests one at a time, and each SLO is the factor "
                             "times the lowest median among the servers (instead of --goodput; default: none)")
    parser.add_argument("--unloaded-prompts", type=int, default=4,
                        help="requests of each server's unloaded run, with --slo-factors")
    parser.add_argument("--reference-requests", type=int, default=0, metavar="K",
                        help="before each load and after a layout's last: K requests one at a time, "
                             "--reference-output-len tokens each, its own prompts: how fast the machine was around "
                             "every point, for `pdserve plan --validate --per-point-speed` (0 = none)")
    parser.add_argument("--reference-output-len", type=int, default=32,
                        help="output tokens of each reference request")
    parser.add_argument("--find-goodput", action="store_true",
                        help="per layout, search the highest rate at which >= 90%% of requests "
                             "meet every SLO (needs --goodput or --slo-factors)")
    parser.add_argument("--goodput-start-rate", type=float, default=1.0,
                        help="first rate the search tries when the listed rates do not bracket the goodput")
    parser.add_argument("--goodput-steps", type=int, default=4, help="bisection runs of the search after bracketing")
    parser.add_argument("--output-dir", default=None,
                        help="where the runs, logs, CSVs and plots go (default: a new folder under the system's temp "
                             "directory, e.g. /tmp/pdserve-sweeps/<time>, outside the repository; name one to keep "
                             "them)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--devices", default=None,
                        help="with --device cuda: GPU indices to use, one per engine (default: 0, 1, 2, ...)")
    add_pin_cpus_arg(parser)
    parser.add_argument("--cores-per-engine", type=int, default=1, help="on CPU with pinning: cores each engine gets")
    parser.add_argument("--up-args", default="", metavar="'ARGS'",
                        help="more `pdserve up` flags, one string (e.g. '--dtype float32 --insecure')")
    parser.add_argument("--api-key", default=None,
                        help="the API key of the servers (pdserve up gets it too; default: none)")
    parser.add_argument("--warmup", type=int, default=4,
                        help="unmeasured short requests (at once) when each server starts, followed by one "
                             "unmeasured request per engine shaped like the runs' own. 0: neither")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a layout may take to start")
    parser.add_argument("--run-timeout", type=float, default=None,
                        help="seconds one bench run may take (default: no limit)")
    parser.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics samples")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")


def resolve_num_prompts(args: argparse.Namespace) -> None:
    """--num-prompts defaults to 50 requests per run; a phased or trace dataset sends its whole schedule at its own
    arrival times, so its runs take no request rate (inf: no more than its own) and no goodput search."""
    if args.dataset not in SCHEDULED_DATASETS:
        args.num_prompts = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
        return
    if any(math.isfinite(rate) for rate in args.request_rates or []) or args.find_goodput:
        raise ValueError(f"--dataset {args.dataset} brings its own arrival times: load it with --request-rates inf "
                         "or --max-concurrencies C, without a rate or --find-goodput")
