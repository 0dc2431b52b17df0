"""`pdserve` command line: parses arguments and hands them to the code that does the work."""

from __future__ import annotations

import argparse
import sys


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or hub id (default: the built-in demo model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="auto: pdserve's native model code when it has the architecture, else the transformers "
                             "backend (transformers' layers on pdserve's KV cache)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs: run every decode step eagerly (graphs exist only on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    keygen = commands.add_parser("keygen", help="write CURVE keys for encrypted, authenticated links (--curve-dir)")
    keygen.add_argument("dir", help="output directory (keep it private: it holds secret keys)")
    keygen.add_argument("--if-missing", action="store_true",
                        help="keep the keys already in DIR (a one-shot compose service runs it on every start)")

    demo = commands.add_parser("demo-model", help="write a random-weight Hugging Face model directory")
    demo.add_argument("dir", help="output directory")
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    demo.add_argument("--size", default="small", choices=["tiny", "small"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--if-missing", action="store_true",
                      help="keep a model already in DIR (a one-shot compose service runs it on every start)")

    generate = commands.add_parser("generate", help="offline generation demo: prints text and tokens/s")
    _add_model_args(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demo prompts")
    generate.add_argument("--num-prompts", type=int, default=8, help="how many prompts when none are given")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=0)
    for role in ("prefill", "decode"):
        from pdserve.engines import add_engine_args

        service = commands.add_parser(role, help=f"run one {role} engine service")
        _add_model_args(service)
        add_engine_args(service, role)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo-model":
            from pdserve.demo_model import has_demo_model, make_demo_model

            if args.if_missing and has_demo_model(args.dir):
                print(f"demo model already in {args.dir}: kept")
                return 0
            path = make_demo_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
            print(f"wrote {args.arch}-{args.size} demo model to {path}")
            return 0
        if args.command == "keygen":
            from pdserve.control.keys import has_cluster_keys, write_cluster_keys

            if args.if_missing and has_cluster_keys(args.dir):
                print(f"CURVE keys already in {args.dir}: kept")
                return 0
            print(f"wrote CURVE keys to {write_cluster_keys(args.dir)}; pass --curve-dir {args.dir} to every process")
            return 0
        if args.command == "generate":
            from pdserve.generate import run_generate

            return run_generate(args)
        if args.command in ("prefill", "decode"):
            from pdserve.engines import run_engine

            return run_engine(args, args.command)
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
    except (ValueError, MemoryError, FileNotFoundError) as exc:
        # Our errors name the problem and the fix; a traceback would only bury that.
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
