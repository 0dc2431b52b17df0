"""The prefill engine's RSS through a soak (issue 49's goal: flat within 5% over 10 minutes once warm).

    python experiments/prefill_rss_soak.py [--model DIR] [--concurrency 4] [--warmup-s 60] [--soak-s 600]

Starts `pdserve up` (the small llama demo model unless --model, 1P1D), sends completions from
--concurrency clients without pause (prompts of 50-600 words, each different, max_tokens 16) for
--warmup-s, then for --soak-s while the prefill engine's RSS is read from /proc every 10 s. Prints the
RSS when warm, at half time and at the end, the growth over the whole soak and over its second half (a plateau
grows little there), the peak, the change per 100 requests, and the answers by status.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time

import httpx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from router_memory_burst import rss_mib, start_up  # noqa: E402  the same `pdserve up` and /proc reading

WORDS = ["prefill", "engine", "memory", "soak", "token", "cache", "block", "router", "decode", "layer", "value"]


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 600)))


async def client(url: str, seed: int, until: float, statuses: collections.Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            answer = await http.post(f"{url}/v1/completions", json={"prompt": prompt(rng), "max_tokens": 16})
            statuses[answer.status_code] += 1


async def load(url: str, concurrency: int, seconds: float, seed: int, statuses: collections.Counter) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(url, seed + i, until, statuses) for i in range(concurrency)))


async def soak(url: str, prefill_pid: int, args: argparse.Namespace) -> tuple[list[tuple[float, int, float]], collections.Counter]:
    statuses: collections.Counter = collections.Counter()
    await load(url, args.concurrency, args.warmup_s, 0, collections.Counter())
    samples = [(0.0, 0, rss_mib(prefill_pid))]
    started = time.monotonic()
    running = asyncio.create_task(load(url, args.concurrency, args.soak_s, 1000, statuses))
    while not running.done():
        await asyncio.sleep(10)
        samples.append((time.monotonic() - started, sum(statuses.values()), rss_mib(prefill_pid)))
    await running
    return samples, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--soak-s", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        process, url, pids = start_up(args.model, log_dir)
        try:
            samples, statuses = asyncio.run(soak(url, pids["prefill-0"], args))
        finally:
            process.terminate()
            process.wait(timeout=60)
    for seconds, requests, rss in samples:
        print(f"  {seconds:6.0f}s  {requests:6d} requests  prefill RSS {rss:7.1f} MiB")
    print(summary(samples, statuses))


def summary(samples: list[tuple[float, int, float]], statuses: collections.Counter) -> str:
    """RSS when warm, at half time and at the end; growth over the soak and over its second half."""
    (_, _, warm), (end_s, num_requests, end) = samples[0], samples[-1]
    _, half_requests, half = min(samples, key=lambda sample: abs(sample[0] - end_s / 2))
    peak = max(rss for _, _, rss in samples)
    return (f"prefill RSS: warm {warm:.0f} MiB, half time {half:.0f} MiB, end ({end_s:.0f}s) {end:.0f} MiB, "
            f"peak {peak:.0f} MiB\n"
            f"growth: whole soak {(end / warm - 1) * 100:+.1f}% ({num_requests} requests, "
            f"{(end - warm) / max(num_requests, 1) * 100:+.2f} MiB per 100); "
            f"second half {(end / half - 1) * 100:+.1f}% ({num_requests - half_requests} requests); "
            f"answers {dict(sorted(statuses.items()))}")


if __name__ == "__main__":
    main()
