"""Test-only stand-in for `pdserve bench` (same flags the sweep passes, same JSON keys): real streamed
requests, one after another, to the server's /v1/completions. `--fail` exits 3 without a result."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import httpx

STATS = ("mean", "median", "std", "p90", "p95", "p99")


def _stats(values_ms: list[float], name: str) -> dict[str, float]:
    import numpy as np

    values = np.array(values_ms or [0.0])
    figures = {"mean": values.mean(), "median": np.median(values), "std": values.std(),
               "p90": np.percentile(values, 90), "p95": np.percentile(values, 95), "p99": np.percentile(values, 99)}
    return {f"{stat}_{name}_ms": float(figures[stat]) for stat in STATS}


def one_request(client: httpx.Client, args: argparse.Namespace, index: int) -> dict:
    body = {"model": args.model, "prompt": [1 + (args.seed * 7919 + index * 131 + i * 17) % 400 for i in range(args.input_len)],
            "max_tokens": args.output_len, "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, usage = [], None
    with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                times.append(time.perf_counter() - start)
    return {"ttft": times[0], "itls": [b - a for a, b in itertools.pairwise(times)], "e2el": times[-1],
            "input_len": usage["prompt_tokens"], "output_len": usage["completion_tokens"], "error": ""}


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--model", "--save-result", "--request-rate"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+")
    parser.add_argument("--metadata", nargs="+", default=[])
    parser.add_argument("--fail", action="store_true")
    args, _ = parser.parse_known_args()
    if args.fail:
        print("stand-in bench: failing as asked", file=sys.stderr)
        return 3
    start = time.perf_counter()
    with httpx.Client(timeout=60) as client:
        requests = []
        for index in range(args.num_prompts):  # one after another, spaced by 1 / rate
            requests.append(one_request(client, args, index))
            time.sleep(0 if args.request_rate == "inf" else 1 / float(args.request_rate))
    duration = time.perf_counter() - start
    result = {"duration": duration, "completed": len(requests), "failed": 0,
              "total_input_tokens": sum(r["input_len"] for r in requests),
              "total_output_tokens": sum(r["output_len"] for r in requests),
              "request_throughput": len(requests) / duration,
              "output_throughput": sum(r["output_len"] for r in requests) / duration, "request_goodput": None,
              "total_token_throughput": sum(r["output_len"] + r["input_len"] for r in requests) / duration,
              **_stats([r["ttft"] * 1000 for r in requests], "ttft"),
              **_stats([(r["e2el"] - r["ttft"]) * 1000 / max(r["output_len"] - 1, 1) for r in requests], "tpot"),
              **_stats([itl * 1000 for r in requests for itl in r["itls"]], "itl"),
              **_stats([r["e2el"] * 1000 for r in requests], "e2el"),
              **{item.split("=", 1)[0]: item.split("=", 1)[1] for item in args.metadata}}
    for key, field in (("ttfts", "ttft"), ("itls", "itls"), ("e2els", "e2el"), ("input_lens", "input_len"),
                       ("output_lens", "output_len"), ("errors", "error")):
        result[key] = [r[field] for r in requests]
    with open(args.save_result, "w") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
