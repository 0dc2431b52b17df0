"""`pdserve profile` and `pdserve plan` flags (argparse only, so building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse

from pdserve.cli_help import seed_arg

DATASETS = ("random", "sharegpt", "prefix", "jsonl", "phased")


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the built-in demo model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--out", default="profile.json", help="where to write the profile JSON")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the engine's dtype, as `pdserve up` takes it; auto: bfloat16 on a CPU with native bf16 "
                             "(avx512_bf16 or AMX), float32 on other CPUs, the checkpoint's dtype on a GPU; the "
                             "profile records what it resolved to (default: auto)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's step token budget")
    parser.add_argument("--core", type=int, default=None,
                        help="CPU core to pin the engine to (default: the first this process may use)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="how many times each shape is timed; 3 steadies the decode figures of a host whose "
                             "speed moves within minutes (a shared CPU machine), for about 2 more minutes")
    parser.add_argument("--quick", action="store_true", help="a handful of small shapes (tests, smoke runs)")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--served-decode", action="store_true",
                        help="CPU only, and the default there: time decode steps through a served engine process, "
                             "as `pdserve up` runs one (its serving loop included)")
    decode.add_argument("--in-process-decode", action="store_true",
                        help="time decode steps in this process, the engine thread's own CPU (the default on GPUs; "
                             "on CPU it misses the serving loop's share of each step)")
    parser.add_argument("--no-corun", action="store_true",
                        help="CPU only: skip the co-run step (how much slower a decode step runs while another core "
                             "computes; about a minute); the plan then assumes engines do not slow each other")
    parser.add_argument("--add-corun-to", default=None, metavar="P.json",
                        help="measure only the co-run step and write P.json with it to --out (a profile taken "
                             "before the step existed; default: a new profile)")
    parser.add_argument("--refit", default=None, metavar="P.json",
                        help="measure nothing: fit P.json's points again with this pdserve's fitting and write the "
                             "profile to --out (a profile taken before the fitting changed; default: measure)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the fits behind the summary: coefficients, R², co-run factors, each step's "
                             "seconds (they are in the JSON either way)")
    parser.add_argument("--clock", default=None, choices=["wall", "cpu"],
                        help="time the fits use: cpu (the default on CPU) counts only the engine thread's own CPU "
                             "time, what a step takes on a core of its own even on a shared machine; wall on GPUs")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, metavar="P.json", help="from `pdserve profile`")
    target = parser.add_mutually_exclusive_group(required=True)  # usage: (--engines N | --validate SWEEP_DIR)
    target.add_argument("--engines", type=int, default=None, metavar="N", help="engines to split into xPyD")
    target.add_argument("--validate", default=None, metavar="SWEEP_DIR",
                        help="replay a `pdserve sweep` directory (its runs/*.json) and compare with what it measured")
    parser.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:2000 tpot:150 (also e2el); with --validate, every run is judged by "
                             "these instead of the SLOs the sweep ran with (default: none)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=None,
                      help="requests per second (Poisson; default: --find-goodput)")
    load.add_argument("--find-goodput", action="store_true",
                      help="per split, the highest rate at which >= 90%% of requests meet every SLO (the default)")
    parser.add_argument("--target-rate", type=float, default=None,
                        help="also find the smallest number of engines whose best split meets this rate "
                             "(default: none)")
    parser.add_argument("--model", default=None,
                        help="check that the profile was measured on this model (default: no check)")
    data = parser.add_argument_group("dataset (as `pdserve bench`)")
    data.add_argument("--dataset", default="random", choices=DATASETS, help="which prompts and lengths to simulate")
    data.add_argument("--dataset-path", default=None, help="the file of a sharegpt or jsonl dataset (default: none)")
    data.add_argument("--tokenizer", default=None, help="tokenizer for sharegpt/prefix/jsonl (default: --model)")
    data.add_argument("--num-prompts", type=int, default=1000, help="simulated requests per split and rate")
    data.add_argument("--input-len", type=int, default=1024, help="random dataset: prompt tokens")
    data.add_argument("--output-len", type=int, default=128, help="random dataset: output tokens")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="random dataset: lengths drawn uniformly within this fraction around the given ones")
    data.add_argument("--prefix-len", type=int, default=None,
                      help="prefix dataset: tokens shared within a group (default: half of --input-len)")
    data.add_argument("--num-prefix-groups", type=int, default=4, help="prefix dataset: groups of prompts")
    data.add_argument("--phases", default=None, metavar="IN:OUT:RATE:SECONDS[:RATIO],...",
                      help="phased: the phases in order, as `pdserve bench` takes them, e.g. 1000:48:2:30,128:256:6:30 "
                           "(or a JSON file of them); simulated at a rate R, every phase's rate is scaled by one factor "
                           "so that the run's mean is R (the phases' rates give the mix, their durations stay); "
                           "--num-prompts does not apply (default: none; required with --dataset phased)")
    data.add_argument("--phase-cycles", type=int, default=1, help="phased: times the phases run, in order")
    data.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma arrivals' shape: 1 = Poisson, below 1 burstier, above 1 steadier")
    data.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompts and arrivals (as bench's)")
    cluster = parser.add_argument_group("cluster (as `pdserve up`)")
    cluster.add_argument("--prefill-policy", default="prefix_aware",
                         choices=["round_robin", "least_loaded", "prefix_aware"],
                         help="the router's choice of prefill engine (prefix_aware is simulated as least_loaded)")
    cluster.add_argument("--decode-policy", default="least_kv", choices=["round_robin", "least_kv"],
                         help="the router's choice of decode engine")
    cluster.add_argument("--local-prefill-threshold", type=int, default=0,
                         help="prompts up to this many tokens are prefilled on the decode engine (0 = none)")
    cluster.add_argument("--kv-streaming", default="off", choices=["on", "off"],
                         help="off: KV sent after the prefill (pdserve's default on CPU); on: layer by layer")
    cluster.add_argument("--adaptive", action="store_true",
                         help="also simulate the N engines as dual-role engines under the adaptive policy (the router "
                              "picks each request's prefill and decode engine, or one engine, from their load and "
                              "the step model), printed beside the best static split; always simulated whole")
    cluster.add_argument("--exact-up-to", type=int, default=8, metavar="N",
                         help="simulate every engine behind the router up to N engines; above, one engine per tier")
    parser.add_argument("--step-scale", nargs=2, type=float, default=(1.0, 1.0), metavar=("PREFILL", "DECODE"),
                        help="multiply the profile's prefill and decode step times (e.g. a profile measured on a "
                             "busier machine than the one planned for); transfers are not scaled; a CPU profile only")
    parser.add_argument("--host-cpu-per-token", type=float, default=None, metavar="US",
                        help="microseconds of host CPU (router, clients) per streamed token that a CPU host runs on "
                             "the engines' cores once none is idle (one core per engine); default: 0 for plan, and "
                             "for --validate with a CPU profile what the sweep measured (its server_cpu_s and "
                             "client_cpu_s, fitted with --host-background-cpu)")
    parser.add_argument("--host-background-cpu", type=float, default=None, metavar="CORES",
                        help="the share of one core the host's processes take whatever the load (0.01 = 1%%), also "
                             "on the engines' cores once none is idle; default as --host-cpu-per-token")
    parser.add_argument("--host-cpu-from", default=None, metavar="SWEEP_DIR",
                        help="--validate: fit the host's CPU figures to this sweep's runs (the same layouts on the "
                             "same machine) instead of the validated sweep's own, e.g. for a sweep that did not "
                             "record server_cpu_s (default: the validated sweep's own runs)")
    parser.add_argument("--per-point-speed", action="store_true",
                        help="--validate: scale the profile's prefill and decode steps at each point by the sweep's "
                             "reference runs around it (`pdserve sweep --reference-requests K`): the model's error "
                             "at the machine's speed of the moment, without its drift since the profile; a CPU "
                             "profile only")
    parser.add_argument("--no-host-effects", action="store_true",
                        help="simulate a CPU profile without what its host adds (co-run factors, the host's CPU, the "
                             "attention's padding): the physical step model alone, as a GPU profile always is")
    parser.add_argument("--diagnose", action="store_true",
                        help="--validate: also each point's diagnostics (decode steps and prefill busy time under load "
                             "against the model, the reference runs' speed, which piece of a request carries the "
                             "attainment error) and the unloaded passes against the profile")
    parser.add_argument("--jobs", type=int, default=2, metavar="J",
                        help="--find-goodput: processes searching the splits at once (the result is the same for any J)")
    parser.add_argument("--output-dir", default=None,
                        help="where the JSON and PNG go (default: a new folder under the system's temp directory, "
                             "e.g. /tmp/pdserve-plans/<time>, outside the repository; name one to keep them)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG")
