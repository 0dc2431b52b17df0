"""`vllm bench serve`'s flags in `pdserve bench`: the ones with no pdserve spelling of their own (--host,
--backend, --result-dir, ...), the refusal of the ones pdserve cannot honour (each with the reason and what
to use), and the step that turns them into pdserve's settings after parsing (docs/benchmarking/bench.md)."""

from __future__ import annotations

import argparse
import math
import re
from datetime import datetime
from pathlib import Path

# vLLM's --dataset-name values pdserve has, under pdserve's name.
DATASET_NAMES = {"random": "random", "sharegpt": "sharegpt", "prefix": "prefix", "jsonl": "jsonl",
                 "custom": "jsonl", "prefix_repetition": "prefix", "phased": "phased", "trace": "trace"}
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}

_HF = ("pdserve bench reads local files only: save the dataset as JSONL and pass --dataset-name custom "
       "--dataset-path FILE")
_ONE_RATE = "pdserve bench sends one --request-rate: run `pdserve sweep --request-rates R1 R2 ...` for several"
_GREEDY = "pdserve bench sends greedy requests (temperature 0), so runs repeat: leave it out"
# vLLM bench flags pdserve cannot honour, and why.
REFUSED_FLAGS = {
    "--append-result": "pdserve writes one JSON per run: give each run its own --result-filename "
                       "(`pdserve sweep` gathers many runs into one CSV)",
    "--use-beam-search": "pdserve serves no beam search: leave it out",
    "--logprobs": "pdserve bench asks for no logprobs: leave it out",
    "--profile": "pdserve's servers have no profiler endpoint: measure an engine with `pdserve profile`",
    "--trust-remote-code": "pdserve runs no code from a model repository: pass --tokenizer a directory that "
                           "transformers' own tokenizer classes load",
    "--lora-modules": "pdserve serves no LoRA adapters: leave it out",
    "--header": "pdserve bench sends one header of its own, the bearer token: give it as --api-key",
    "--ready-check-timeout-sec": "pdserve bench checks the server once, before any load: start it first "
                                 "(`pdserve up` returns once it is ready)",
    "--no-oversample": "a file with fewer requests than --num-prompts is sent again from its start: lower "
                       "--num-prompts to send each request once",
    "--disable-shuffle": "ShareGPT conversations are picked by --seed, and JSONL is sent in file order: leave it out",
    "--random-batch-size": "pdserve bench sends one prompt per request: leave it out",
    **dict.fromkeys(["--ramp-up-strategy", "--ramp-up-start-rps", "--ramp-up-end-rps"], _ONE_RATE),
    **dict.fromkeys(["--temperature", "--top-p", "--top-k", "--min-p"], _GREEDY),
    **dict.fromkeys(["--no-stream", "--hf-subset", "--hf-split", "--hf-name", "--hf-output-len"], _HF),
    **dict.fromkeys(["--sonnet-input-len", "--sonnet-output-len", "--sonnet-prefix-len"],
                    "pdserve has no sonnet dataset: use --dataset-name random (exact lengths) or custom"),
}


class RefusedFlag(argparse.Action):
    """A vLLM bench flag pdserve cannot honour, hidden from --help: refused with the reason on sight."""

    def __init__(self, option_strings: list[str], dest: str, reason: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(self, f"vLLM's flag is not supported: {self.reason}")


def dataset_name(text: str) -> str:
    """argparse type of --dataset / --dataset-name: pdserve's names and vLLM's for the same datasets."""
    if text in DATASET_NAMES:
        return DATASET_NAMES[text]
    raise argparse.ArgumentTypeError(
        f"{text!r}: pdserve bench has random, sharegpt, prefix (vLLM's prefix_repetition), jsonl (vLLM's "
        "custom), phased and trace; for another dataset save it as JSONL lines {\"prompt\": ..., \"output_len\": N} and pass "
        "--dataset-name custom --dataset-path FILE")


def backend_endpoint(text: str) -> str:
    """argparse type of --backend / --endpoint-type: the endpoint its requests go to."""
    if text in BACKEND_ENDPOINTS:
        return BACKEND_ENDPOINTS[text]
    raise argparse.ArgumentTypeError(f"{text!r}: pdserve bench speaks the OpenAI API: give openai (or vllm) for "
                                     "/v1/completions, openai-chat for /v1/chat/completions")


def tokenizer_mode(text: str) -> str:
    if text in ("auto", "hf"):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: pdserve loads tokenizers with transformers' AutoTokenizer "
                                     "(vLLM's auto): leave --tokenizer-mode out")


def percentile_metrics(text: str) -> tuple[str, ...]:
    from pdserve.bench.serve_metrics import LATENCY_METRICS

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {','.join(LATENCY_METRICS)}")
    return names


def metric_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < value <= 100 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated percentiles in (0, 100], e.g. 50,90,99")
    return values


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags with no pdserve spelling of their own; the ones pdserve refuses, hidden."""
    vllm = parser.add_argument_group("vLLM bench serve's flags (docs/benchmarking/bench.md)")
    vllm.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    vllm.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    vllm.add_argument("--backend", "--endpoint-type", dest="backend_endpoint", type=backend_endpoint, default=None,
                      metavar="{openai,vllm,openai-chat}",
                      help="the API the load goes to, when --endpoint is not given (default: openai)")
    vllm.add_argument("--served-model-name", default=None,
                      help="the model name sent in requests, when --model names the tokenizer (default: --model)")
    vllm.add_argument("--tokenizer-mode", type=tokenizer_mode, default="auto", help="auto only")
    vllm.add_argument("--label", default=None, help="the result's label and file-name prefix (default: the backend)")
    vllm.add_argument("--result-dir", default=None,
                      help="with --save-result alone: the folder of the JSON (default: the current one)")
    vllm.add_argument("--result-filename", default=None,
                      help="with --save-result alone: the JSON's name (default: LABEL-RATEqps-MODEL-DATE.json)")
    vllm.add_argument("--save-detailed", action="store_true",
                      help="taken as vLLM's: the JSON always holds the per-request arrays")
    vllm.add_argument("--skip-chat-template", action="store_true",
                      help="taken as vLLM's: pdserve bench sends prompts as they are, never in a chat template")
    vllm.add_argument("--percentile-metrics", type=percentile_metrics, default=None, metavar="ttft,tpot,itl,e2el",
                      help="the metrics --metric-percentiles adds keys for (default: all four)")
    vllm.add_argument("--metric-percentiles", type=metric_percentiles, default=None, metavar="P,P",
                      help="percentiles written as p{P}_{metric}_ms besides the p90, p95 and p99 always there "
                           "(default: none more)")
    vllm.add_argument("--prefix-repetition-suffix-len", dest="suffix_len", type=int, default=None,
                      help="prefix dataset: tokens after the shared prefix; the prompt is --prefix-len plus these "
                           "(default: --input-len minus --prefix-len)")
    vllm.add_argument("--random-prefix-len", type=int, default=0,
                      help="random dataset: tokens every prompt shares before its --input-len random ones")
    for flag, reason in REFUSED_FLAGS.items():
        parser.add_argument(flag, action=RefusedFlag, reason=reason)


def resolve_vllm_args(args: argparse.Namespace) -> None:
    """vLLM's flags turned into pdserve's settings, in place (before the checks): the URL, the endpoint,
    the model and the prompt lengths the flags mean."""
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    chosen = args.backend_endpoint or BACKEND_ENDPOINTS["openai"]
    if args.endpoint is not None and args.backend_endpoint and args.endpoint != args.backend_endpoint:
        raise ValueError(f"--backend asks for {args.backend_endpoint} but --endpoint is {args.endpoint}: give one")
    args.endpoint = args.endpoint or chosen
    if args.served_model_name:
        args.tokenizer = args.tokenizer or args.model
        args.model = args.served_model_name
    if args.suffix_len is not None:
        if args.dataset != "prefix" or args.prefix_len is None:
            raise ValueError("--prefix-repetition-suffix-len goes with --dataset-name prefix_repetition and "
                             "--prefix-repetition-prefix-len")
        args.input_len = args.prefix_len + args.suffix_len
    if args.random_prefix_len:
        if args.dataset != "random" or args.random_prefix_len < 0:
            raise ValueError(f"--random-prefix-len {args.random_prefix_len} goes with --dataset-name random and "
                             "is 0 or more")
        args.dataset, args.prefix_len, args.num_prefix_groups = "prefix", args.random_prefix_len, 1
        args.input_len += args.random_prefix_len
        args.random_prefix_len = 0  # applied: resolving again changes nothing


def result_path(args: argparse.Namespace, model: str, now: datetime) -> Path | None:
    """Where the JSON goes: --save-result PATH, or with --save-result alone (vLLM's way) --result-dir and
    --result-filename, named as vLLM names it when no file name is given; None when nothing is saved."""
    if args.save_result:
        return Path(args.save_result)
    if args.save_result is None and not (args.result_dir or args.result_filename):
        return None
    label = args.label or ("openai-chat" if args.endpoint.endswith("/chat/completions") else "openai")
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model_name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name or model)
    name = args.result_filename or f"{label}-{rate}qps{concurrency}-{model_name}-{now:%Y%m%d-%H%M%S}.json"
    return Path(args.result_dir or ".") / name
