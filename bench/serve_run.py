"""One `pdserve bench` run, in order: the server checked before any load, the tokenizer and the prompts,
the request shape the server takes, the warmup, the measured load, then the table and the JSON."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.serve import DEFAULT_OUTPUT_LEN, SCHEDULED_DATASETS, base_url_of
from pdserve.bench.serve_arrivals import arrival_offsets
from pdserve.bench.serve_client import COMPLETIONS_ENDPOINT, RequestShape
from pdserve.bench.serve_datasets import (
    SampleRequest,
    jsonl_dataset,
    prefix_dataset,
    random_dataset,
    repeat_to,
    sharegpt_dataset,
)
from pdserve.bench.serve_load import LoadOutcome, LoadTarget, open_session, run_load
from pdserve.bench.serve_metrics import compute_metrics, extra_percentiles
from pdserve.bench.serve_phase_report import format_phase_table, phase_results
from pdserve.bench.serve_preflight import ServedModel, ServerCheckError, served_models, supported_shape
from pdserve.bench.serve_results import (
    METRIC_KEYS,
    PER_REQUEST_KEYS,
    PHASE_KEYS,
    build_result,
    format_table,
    parse_metadata,
    save_result,
)
from pdserve.bench.serve_schedule import Schedule, phased_schedule, trace_schedule
from pdserve.bench.serve_trace import write_trace
from pdserve.bench.serve_vllm_args import result_path
from pdserve.engine.tokenizer import TokenizerLoadError, load_tokenizer

NEEDS_TOKENIZER = ("random", "prefix", "sharegpt", "phased")
CLIENT_BUSY_SHARE = 0.9
MIN_BUSY_CHECK_S = 1.0  # shorter runs are mostly start-up: their CPU share says nothing


def note(message: str) -> None:
    print(f"pdserve bench: {message}", file=sys.stderr, flush=True)


def settings_of(args: argparse.Namespace, model: str, tokenizer_id: str | None, shape: RequestShape, slos: dict,
                notes: list[str]) -> dict:
    """The run's settings, as they go into the JSON (vLLM's names where it has them)."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": "openai" if args.endpoint == COMPLETIONS_ENDPOINT else "openai-chat",
        "base_url": base_url_of(args.base_url), "endpoint": args.endpoint,
        "model_id": model, "tokenizer_id": tokenizer_id,
        "dataset": args.dataset, "dataset_path": args.dataset_path, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len, "num_prefix_groups": args.num_prefix_groups,
        "phase_spec": args.phases, "phase_cycles": args.phase_cycles if args.phases else None,
        "request_rate": args.request_rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "seed": args.seed, "warmup": args.warmup, "request_timeout": args.request_timeout,
        "ignore_eos": args.ignore_eos, "ignore_eos_sent": shape.ignore_eos, "min_tokens_sent": shape.min_tokens,
        "token_id_prompts": shape.token_id_prompts, "include_usage": shape.include_usage,
        "goodput": slos or None, "label": args.label, "notes": notes,
    }


@dataclass(frozen=True)
class BenchTokenizer:
    tokenizer: object | None
    name: str | None

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def load_bench_tokenizer(args: argparse.Namespace, model: str, served: list[ServedModel]) -> BenchTokenizer:
    """--tokenizer, else the first local directory among --model and the paths the server reports, else
    (for the datasets that need one) the model name as a hub id. JSONL runs without one."""
    local = next((c for c in (model, *(card.root for card in served if card.root)) if Path(c).is_dir()), None)
    name = args.tokenizer or local or (model if args.dataset in NEEDS_TOKENIZER else None)
    if name is None:
        note(f"no tokenizer (pass --tokenizer; {model} is no local directory): token counts are the server's usage")
        return BenchTokenizer(None, None)
    try:
        return BenchTokenizer(load_tokenizer(name), name)
    except TokenizerLoadError as exc:
        if args.tokenizer or args.dataset in NEEDS_TOKENIZER:
            raise ValueError(f"{exc}; pass --tokenizer DIR (the served model's tokenizer)") from exc
        note(f"no tokenizer ({exc}): token counts are the server's usage")
        return BenchTokenizer(None, None)


def make_samples(args: argparse.Namespace, tokenizer, count: int) -> list[SampleRequest]:
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset == "random":
        return random_dataset(tokenizer, count, args.input_len, output_len, args.range_ratio, args.seed)
    if args.dataset == "prefix":
        prefix_len = args.prefix_len if args.prefix_len is not None else args.input_len // 2
        return prefix_dataset(tokenizer, count, args.input_len, output_len, args.range_ratio, prefix_len,
                              args.num_prefix_groups, args.seed)
    if args.dataset == "sharegpt":
        samples = sharegpt_dataset(args.dataset_path, tokenizer, count, args.output_len, args.seed)
    else:
        samples = jsonl_dataset(args.dataset_path, tokenizer, count, args.output_len)
    if len(samples) < count:
        note(f"{args.dataset_path} has {len(samples)} usable requests for {count} (warmup included): sending them "
             "again from the start")
    return repeat_to(samples, count)


def make_schedule(args: argparse.Namespace, tokenizer) -> Schedule:
    """The run's warmup and measured requests with their arrival offsets (phase windows for phased and trace);
    for those two, --num-prompts (if given) keeps the first N, and is then set to the number measured."""
    if args.dataset not in SCHEDULED_DATASETS:
        samples = make_samples(args, tokenizer, args.warmup + args.num_prompts)
        offsets = arrival_offsets(args.num_prompts, args.request_rate, args.burstiness, args.seed)
        return Schedule(samples[args.warmup:], offsets.tolist(), samples[:args.warmup])
    schedule = phased_schedule(args, tokenizer) if args.dataset == "phased" else trace_schedule(args, tokenizer)
    if args.num_prompts is not None and args.num_prompts < len(schedule.samples):
        note(f"--num-prompts {args.num_prompts}: sending the first {args.num_prompts} of the "
             f"{len(schedule.samples)} requests of the {args.dataset} schedule")
        schedule = schedule.first_n(args.num_prompts)
    args.num_prompts = len(schedule.samples)
    return schedule


async def warm_up_and_measure(session, target: LoadTarget, schedule: Schedule,
                              args: argparse.Namespace) -> LoadOutcome:
    """The warmup sent at once (not measured), then the measured requests on their arrival times."""
    if schedule.warmup:
        count = len(schedule.warmup)
        warm = await run_load(session, target, schedule.warmup, [0.0] * count, args.max_concurrency)
        if warm.interrupted:
            raise KeyboardInterrupt  # nothing measured yet: no results
        note(f"warmup: {count} requests sent, {sum(not r.success for r in warm.results)} failed")
    with tqdm(total=len(schedule.samples), desc="pdserve bench", unit="req", file=sys.stderr,
              disable=True if args.disable_progress else None,  # None: off when stderr is no terminal
              dynamic_ncols=True) as progress:
        return await run_load(session, target, schedule.samples, schedule.offsets, args.max_concurrency,
                              on_done=lambda result: progress.update(1))


def _reserved_keys(args: argparse.Namespace) -> set[str]:
    settings = settings_of(args, "", None, RequestShape(args.endpoint, ""), {}, [])
    return {*METRIC_KEYS, *PER_REQUEST_KEYS, *PHASE_KEYS, *settings}


async def bench_main(args: argparse.Namespace, base_url: str, slos: dict[str, float]) -> int:
    metadata = parse_metadata(args.metadata, _reserved_keys(args))
    # Its own session: loading the prompts blocks this loop, and a pooled connection the server closed
    # meanwhile would not be noticed before it is reused.
    async with open_session(args.api_key, args.request_timeout, 1) as session:
        served = await served_models(session, base_url)
    model = args.model or (served[0].id if served else None)
    if not model:
        raise ServerCheckError(f"{base_url}/v1/models lists no model: pass --model")
    tokenizer = load_bench_tokenizer(args, model, served)
    schedule = make_schedule(args, tokenizer.tokenizer)
    if args.save_trace:
        path = write_trace(args.save_trace, schedule.samples, schedule.offsets, schedule.windows, schedule.owners)
        note(f"trace of the {len(schedule.samples)} measured requests written to {path}")
    samples = schedule.samples
    async with open_session(args.api_key, args.request_timeout, args.max_concurrency) as session:
        asked = RequestShape(args.endpoint, model, ignore_eos=args.ignore_eos, min_tokens=args.ignore_eos,
                             token_id_prompts=args.endpoint == COMPLETIONS_ENDPOINT
                             and samples[0].prompt_token_ids is not None)
        url = base_url + args.endpoint
        shape, notes = await supported_shape(session, url, asked, samples[0], args.request_timeout)
        for line in notes:
            note(line)
        target = LoadTarget(url, shape, args.request_timeout, tokenizer.count if tokenizer.tokenizer else None)
        load = await warm_up_and_measure(session, target, schedule, args)
    results = load.results
    if load.interrupted:
        notes.append(f"interrupted (Ctrl-C) after {len(results)} of {args.num_prompts} measured requests ended: "
                     "the metrics cover those")
        note(notes[-1])
    metrics = {**compute_metrics(results, load.duration_s, slos), "client_cpu_s": load.client_cpu_s,
               **extra_percentiles(results, args.percentile_metrics, args.metric_percentiles)}
    if load.duration_s >= MIN_BUSY_CHECK_S and load.client_cpu_s > CLIENT_BUSY_SHARE * load.duration_s:
        notes.append(f"the client was busy {100 * load.client_cpu_s / load.duration_s:.0f}% of the run on its core: "
                     "it may have been the bottleneck (docs/results.md has its ceiling)")
        note(notes[-1])
    settings = settings_of(args, model, tokenizer.name, shape, slos, notes)
    phases = []
    if schedule.windows:
        phases = phase_results(schedule.windows, schedule.owners, load.indices, results, slos,
                               args.percentile_metrics, args.metric_percentiles)
    print(format_table(metrics, settings, results), flush=True)
    if phases:
        print(format_phase_table(phases), flush=True)
    out = result_path(args, model, datetime.now())
    if out is not None:
        request_phases = [schedule.owners[i] for i in load.indices] if phases else None
        result = build_result(metrics, results, settings, metadata, phases, request_phases)
        note(f"results written to {save_result(out, result)}")
    if load.interrupted:
        return 130
    return 0 if metrics["completed"] else 1
