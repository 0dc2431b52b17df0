"""`pdserve bench`: an online load against any OpenAI-compatible server, with vLLM bench serve's metrics
(docs/benchmarking/bench.md).

Order of a run: check the server (before any load), load the tokenizer and the prompts, find which
request fields the server takes, warm up, send the measured load, print the table, save the JSON.
Heavy imports (aiohttp, numpy, transformers) happen in run_bench, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from pdserve.bench.serve_vllm_args import add_vllm_args, dataset_name, resolve_vllm_args
from pdserve.cli_help import seed_arg

DATASETS = ("random", "sharegpt", "prefix", "jsonl", "phased", "trace")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_OUTPUT_LEN = 128
DEFAULT_NUM_PROMPTS = 1000
SCHEDULED_DATASETS = ("phased", "trace")  # their arrival times come with them, not from --request-rate


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """pdserve's flags, with vLLM bench serve's spelling of the same setting beside each (--dataset-name,
    --random-input-len, ...), then vLLM's flags that have no pdserve spelling."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help="the server's root URL, without /v1 (default: http://HOST:PORT, http://127.0.0.1:8000)")
    server.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                        help="the API the load goes to (default: --backend's, /v1/completions)")
    server.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    server.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or hub id (default: --model, or the model's path the server reports)")
    server.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $PDSERVE_API_KEY, then $OPENAI_API_KEY)")
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="a request that receives no data for S seconds fails as stalled")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", default="random", type=dataset_name,
                      metavar="{" + ",".join(DATASETS) + "}",
                      help="random: exact token counts; sharegpt / jsonl: prompts from --dataset-path; prefix: "
                           "prompts sharing a prefix (vLLM's custom and prefix_repetition are jsonl and prefix); "
                           "phased: a workload that shifts (--phases); trace: a JSONL replayed at its arrival offsets")
    data.add_argument("--dataset-path", default=None,
                      help="the file of --dataset sharegpt, jsonl or trace (default: none)")
    data.add_argument("--num-prompts", type=int, default=None,
                      help=f"measured requests (default {DEFAULT_NUM_PROMPTS}; phased, trace: all the schedule's, "
                           "or its first N)")
    data.add_argument("--input-len", "--random-input-len", type=int, default=1024,
                      help="prompt tokens (random, prefix)")
    data.add_argument("--output-len", "--random-output-len", "--sharegpt-output-len", "--custom-output-len",
                      "--prefix-repetition-output-len", type=int, default=None,
                      help=f"max_tokens per request (random, prefix: default {DEFAULT_OUTPUT_LEN}; sharegpt: "
                           "overrides the reply's length; jsonl: for lines without their own)")
    data.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)] (random, prefix)")
    data.add_argument("--prefix-len", "--prefix-repetition-prefix-len", type=int, default=None,
                      help="tokens each prefix group shares, within --input-len (default: half of it)")
    data.add_argument("--num-prefix-groups", "--prefix-repetition-num-prefixes", type=int, default=4,
                      help="groups of prompts sharing a prefix")
    data.add_argument("--phases", default=None, metavar="IN:OUT:RATE:SECONDS[:RATIO],...",
                      help="phased: the phases in order, each input and output length, requests per second, seconds "
                           "and optional range ratio, e.g. 1000:48:0.3:60,128:256:1:60; or a JSON file of them (default: none; "
                           "required with --dataset phased)")
    data.add_argument("--phase-cycles", type=int, default=1, help="phased: times the phases run, in order")
    data.add_argument("--save-trace", default=None, metavar="PATH",
                      help="write the measured requests and their arrival offsets as a JSONL trace, which "
                           "--dataset trace replays (default: none)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    load.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompts, arrival times and sampling")
    load.add_argument("--warmup", type=int, default=0, metavar="N", help="requests sent first and not measured")
    load.add_argument("--num-warmups", dest="warmup", type=int, default=argparse.SUPPRESS, metavar="N",
                      help="vLLM's spelling of --warmup (default: 0)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="exact output lengths: send ignore_eos (and min_tokens) where the server takes them")
    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for request_goodput, e.g. ttft:2000 tpot:100 e2el:10000 (default: none)")
    out.add_argument("--save-result", nargs="?", const="", default=None, metavar="PATH",
                     help="write the results as JSON to PATH; alone (as vLLM's flag), to --result-dir/"
                          "--result-filename (default: no JSON)")
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                     help="added to the JSON (default: none)")
    out.add_argument("--disable-progress", "--disable-tqdm", action="store_true", help="no progress bar")
    add_vllm_args(parser)


def check_args(args: argparse.Namespace) -> None:
    """Refuses bad values before any work; first turns vLLM's flags into pdserve's settings."""
    from pdserve.bench.serve_arrivals import check_arrival_args, check_arrival_span

    resolve_vllm_args(args)
    check_scheduled_args(args)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts} must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} must be 0 or more")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency} must be at least 1 (or left out: no cap)")
    if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
        raise ValueError(f"--request-timeout {args.request_timeout} must be a positive, finite number of seconds "
                         "(e.g. 3600 for an hour)")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len {args.output_len} must be at least 1")
    if args.dataset in ("sharegpt", "jsonl", "trace") and not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} reads a file: pass --dataset-path FILE")
    if args.save_trace:
        check_save_path(args.save_trace, "--save-trace")
    if args.save_result:
        check_save_path(args.save_result)
    elif args.result_dir:
        check_output_dir(args.result_dir, "--result-dir")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {args.base_url!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")
    check_arrival_args(args.request_rate, args.burstiness)
    if args.dataset not in SCHEDULED_DATASETS:
        check_arrival_span(args.num_prompts, args.request_rate)


def check_scheduled_args(args: argparse.Namespace) -> None:
    """The phased and trace datasets bring their own arrivals: --request-rate is theirs, and --num-prompts
    (if given) takes their first N requests; --phases goes with phased only."""
    if args.dataset in SCHEDULED_DATASETS and math.isfinite(args.request_rate):
        where = "the phases give" if args.dataset == "phased" else "the trace's arrival_s give"
        raise ValueError(f"--request-rate {args.request_rate:g} with --dataset {args.dataset}: {where} the arrival "
                         "times: leave --request-rate out (with `pdserve sweep`, use --max-concurrencies)")
    if args.dataset == "phased" and not args.phases:
        raise ValueError("--dataset phased needs --phases IN:OUT:RATE:SECONDS,..., e.g. --phases "
                         "1000:48:0.3:60,128:256:1:60")
    if args.dataset != "phased" and (args.phases or args.phase_cycles != 1):
        raise ValueError("--phases and --phase-cycles go with --dataset phased: add it, or leave them out")
    if args.dataset == "phased":
        from pdserve.bench.serve_phases import parse_phases, phase_windows

        phase_windows(parse_phases(args.phases), args.phase_cycles)  # a bad phase is found before any work
    if args.num_prompts is None and args.dataset not in SCHEDULED_DATASETS:
        args.num_prompts = DEFAULT_NUM_PROMPTS


def check_save_path(path: str, flag: str = "--save-result") -> None:
    """The output file can be written: checked before the work, whose results would otherwise be lost."""
    from pathlib import Path

    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file path, e.g. {out / 'result.json'}")
    _check_no_file_above(out, path, flag)


def check_output_dir(path: str, flag: str = "--output-dir") -> None:
    """The output directory can be made: checked before the work, whose results would otherwise be lost."""
    from pathlib import Path

    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {path} is a file: give a directory (it is made if missing)")
    _check_no_file_above(out, path, flag)


def new_output_dir(kind: str):
    """A new folder under the system's temp directory, e.g. /tmp/pdserve-sweeps/<time> (kind "sweeps"): raw
    results (megabytes) stay out of the repository unless --output-dir names a place."""
    import tempfile
    import time
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"pdserve-{kind}" / time.strftime("%Y%m%d-%H%M%S")


def _check_no_file_above(out, path: str, flag: str) -> None:
    """The nearest existing folder above `out` is a folder, not a file."""
    taken = next((parent for parent in out.parents if parent.exists()), None)
    if taken is not None and not taken.is_dir():
        raise ValueError(f"{flag} {path}: {taken} is a file, not a directory: give a path in a directory")


def base_url_of(url: str) -> str:
    """The server's root: without a trailing slash or /v1 (both are often pasted from client configs)."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def run_bench(args: argparse.Namespace) -> int:
    """0 when at least one measured request completed, 1 when none did (the JSON is written either way);
    bad arguments, files or an unusable server raise ValueError before any load."""
    import asyncio

    from pdserve.bench.serve_metrics import parse_slos
    from pdserve.bench.serve_run import bench_main

    check_args(args)
    slos = parse_slos(args.goodput)
    try:
        return asyncio.run(bench_main(args, base_url_of(args.base_url), slos))
    except KeyboardInterrupt:
        print("pdserve bench: interrupted; no results", file=sys.stderr)
        return 130

