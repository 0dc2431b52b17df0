"""`pdserve` command line: parses arguments and hands them to the code that does the work."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli_help import dtype_arg, option_strings, positive_int, seed_arg, unrecognized_message, use_defaults_help


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or hub id (default: the built-in demo model)")
    parser.add_argument("--dtype", default="auto", type=dtype_arg, choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute and KV cache dtype; auto: bfloat16 on a CPU with native bf16 (avx512_bf16 or AMX), "
                             "float32 on other CPUs, the checkpoint's dtype on a GPU "
                             "(vLLM's half and float are float16 and float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV cache block")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV cache size in blocks (default: 1 GiB on CPU; on CUDA, 90%% of the GPU memory left "
                             "after the weights)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, help="most requests in one batch")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget of one step")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context length in tokens, prompt included (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV blocks of prompt prefixes seen before")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="auto: pdserve's native model code when it has the architecture, else the transformers "
                             "backend (transformers' layers on pdserve's KV cache)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs: run every decode step eagerly (graphs exist only on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    keygen = commands.add_parser("keygen", help="write CURVE keys for encrypted, authenticated links (--curve-dir)")
    keygen.add_argument("dir", nargs="?", help="output directory (keep it private: it holds secret keys)")
    keygen.add_argument("--secret-manifest", metavar="NAME", default=None,
                        help="print new keys as a Kubernetes Secret NAME instead of writing DIR: "
                             "`pdserve keygen --secret-manifest pdserve-cluster-keys | kubectl apply -f -` (default: write DIR)")
    keygen.add_argument("--if-missing", action="store_true",
                        help="keep the keys already in DIR (a one-shot compose service runs it on every start)")
    keygen.add_argument("--force", action="store_true",
                        help="replace the keys already in DIR (every process must then restart with the new keys)")

    demo = commands.add_parser("demo-model", help="write a random-weight Hugging Face model directory")
    demo.add_argument("dir", help="output directory (new or empty, unless --force)")
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"],
                      help="Hugging Face architecture of the model")
    demo.add_argument("--size", default="small", choices=["tiny", "small"],
                      help="tiny: a few MB, for tests; small: SmolLM-135M-shaped (about 500 MB)")
    demo.add_argument("--seed", type=seed_arg, default=0, help="random seed of the weights (same seed, same bytes)")
    demo.add_argument("--force", action="store_true", help="write into DIR even when it already holds files")
    demo.add_argument("--if-missing", action="store_true",
                      help="keep the model already in DIR, else build it (a one-shot compose service runs it on "
                           "every start)")
    demo.add_argument("--for-model", default=None, metavar="MODEL",
                      help="build only when MODEL, the model the other services are given, is DIR (compose: "
                           "skipped when PDSERVE_MODEL names another model; default: always build)")

    generate = commands.add_parser("generate", help="offline generation demo: prints text and tokens/s")
    _add_model_args(generate)
    generate.add_argument("--prompt", action="append",
                          help="a prompt; repeat the flag for several (--prompt Hello --prompt 'Once upon'); "
                               "default: a few demo prompts")
    generate.add_argument("--num-prompts", type=int, default=8, help="how many prompts when none are given")
    generate.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt, at most")
    generate.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    generate.add_argument("--seed", type=seed_arg, default=0, help="random seed of the engine and of sampling")
    for role in ("prefill", "decode"):
        from pdserve.engines import add_engine_args

        service = commands.add_parser(role, help=f"run one {role} engine service")
        _add_model_args(service)
        add_engine_args(service, role)
    dual = commands.add_parser("engine", help="run one engine that takes either role per request: prefill for a "
                                              "peer, decode from a peer's KV, or both")
    _add_model_args(dual)
    add_engine_args(dual, "dual")
    from pdserve.router_cli import add_router_args
    from pdserve.up import add_up_args

    router = commands.add_parser("router", help="run the OpenAI-compatible HTTP router")
    router.add_argument("--model", default=None,
                        help="model directory or hub id whose tokenizer and chat template the router uses "
                             "(default: the built-in demo model)")
    add_router_args(router)
    up = commands.add_parser("up", help="start a router and prefill/decode engines on this machine")
    _add_model_args(up)
    add_router_args(up, standalone=False)
    add_up_args(up)
    from pdserve.bench.serve import add_bench_args

    bench = commands.add_parser("bench", help="send an online load to an OpenAI-compatible server and measure "
                                               "TTFT, TPOT, ITL, E2EL, throughput and goodput")
    add_bench_args(bench)
    from pdserve.bench.sweep_args import add_sweep_args

    sweep = commands.add_parser("sweep", help="benchmark xPyD layouts of `pdserve up` across loads; CSV and plots")
    add_sweep_args(sweep)
    from pdserve.planner.args import add_plan_args, add_profile_args

    add_profile_args(commands.add_parser("profile", help="measure one engine's step and KV transfer times for "
                                                         "`pdserve plan`"))
    add_plan_args(commands.add_parser("plan", help="simulate every xPyD split from a profile and recommend one; "
                                                   "--validate replays a sweep"))
    use_defaults_help(parser)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def run_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.control.keys import cluster_keys_secret, has_cluster_keys, write_cluster_keys

    if args.secret_manifest:
        print(cluster_keys_secret(args.secret_manifest))
        return 0
    if not args.dir:
        raise ValueError("keygen needs an output directory DIR, or --secret-manifest NAME for Kubernetes")
    taken = next((path for path in (Path(args.dir), *Path(args.dir).parents) if path.exists()), None)
    if taken is not None and not taken.is_dir():
        raise ValueError(f"{taken} is a file: give keygen a directory path for the keys")
    if has_cluster_keys(args.dir):
        if args.if_missing:
            print(f"CURVE keys already in {args.dir}: kept")
            return 0
        if not args.force:
            raise FileExistsError(f"{args.dir} already holds CURVE keys, which running processes may use: pass "
                                  f"--force to replace them (then restart every process with the new keys), or "
                                  f"--if-missing to keep them")
    print(f"wrote CURVE keys to {write_cluster_keys(args.dir)}; pass --curve-dir {args.dir} to every process")
    return 0


def describe_os_error(exc: OSError) -> str:
    """An OSError as one line naming the path, e.g. "/a/b: Not a directory: check the path (and its permissions)"."""
    if exc.filename is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror or exc}: check the path (and its permissions)"


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C while loading, building or measuring: no traceback
        print("pdserve: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    from pdserve.control.errors import TransportError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, and what pdserve takes instead of a vLLM or SGLang flag
        command = _subcommand_parser(parser, args.command)
        command.error(unrecognized_message(unknown, option_strings(command)))
    try:
        if args.command == "demo-model":
            from pdserve.demo_model import run_demo_model_command

            print(run_demo_model_command(args))
            return 0
        if args.command == "keygen":
            return run_keygen(args)
        if args.command == "generate":
            from pdserve.generate import run_generate

            return run_generate(args)
        if args.command in ("prefill", "decode", "engine"):
            from pdserve.engines import run_engine

            return run_engine(args, "dual" if args.command == "engine" else args.command)
        if args.command == "router":
            from pdserve.router_cli import run_router

            return run_router(args)
        if args.command == "up":
            from pdserve.up import run_up

            return run_up(args)
        if args.command == "bench":
            from pdserve.bench.serve import run_bench

            return run_bench(args)
        if args.command == "sweep":
            from pdserve.bench.sweep import run_sweep

            return run_sweep(args)
        if args.command in ("profile", "plan"):
            from pdserve.planner.cli import run_plan, run_profile

            return run_profile(args) if args.command == "profile" else run_plan(args)
    except (ValueError, MemoryError, FileNotFoundError, FileExistsError, TransportError) as exc:
        # Our errors name the problem and the fix; a traceback would only bury that.
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that is a file, not a directory, or not ours to write
        print(f"pdserve {args.command}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
