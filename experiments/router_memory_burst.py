"""The router's memory and /health latency through a burst of big prompts (issue 49's memory goal).

    python experiments/router_memory_burst.py [--model DIR] [--concurrency 32] [--prompt-mib 3.9]
                                              [--settle-s 60] [--kind completion|chat|both]

Starts `pdserve up` (the small llama demo model unless --model, 1P1D), waits until it serves, then sends
--concurrency requests at once, each with a prompt of --prompt-mib MiB of words (too long for the
model: a 400 or, when the body budget is full, a 503, is the right answer). Meanwhile the router's RSS
is read from /proc/<pid>/status every 50 ms and /health is asked every 100 ms. Prints the baseline RSS
(before the burst), the peak, the RSS --settle-s seconds after the last answer, the answers by status,
and the slowest /health.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0.0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(self.interval_s)


def start_up(model: str | None, log_dir: str) -> tuple[subprocess.Popen, str, dict[str, int]]:
    """`pdserve up`, its URL, and each component's pid by name (router, prefill-0, decode-0)."""
    command = [sys.executable, "-m", "pdserve", "up", "--port", "0", "--log-dir", log_dir, "--log-level", "warning",
               "--max-model-len", "2048"] + (["--model", model] if model else [])
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = {}
    for line in process.stdout:
        print(line, end="", flush=True)
        if line.startswith("[pdserve up] ") and " ready (" in line:
            pids[line.split()[2]] = int(line.split(" pid ")[1].split(",")[0])
        if line.startswith("PDSERVE_READY role=up"):
            fields = dict(item.split("=", 1) for item in line.split()[1:])
            return process, fields["url"], pids
    raise RuntimeError("pdserve up exited before it was ready")


def big_prompt(num_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["the", "router", "memory", "prompt", "token", "engine", "burst", "health", "value", "décodé", "数据"]
    parts, size = [], 0
    while size < num_bytes:
        word = rng.choice(words)
        parts.append(word)
        size += len(word.encode()) + 1
    return " ".join(parts)


def request_body(kind: str, prompt: str) -> tuple[str, dict]:
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    return "/v1/completions", {"prompt": prompt, "max_tokens": 4}


async def poll_health(client: httpx.AsyncClient, url: str, done: asyncio.Event, latencies: list[float]) -> None:
    while not done.is_set():
        start = time.perf_counter()
        await client.get(f"{url}/health")
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)


async def burst(url: str, args: argparse.Namespace) -> tuple[collections.Counter, list[float]]:
    prompt = big_prompt(int(args.prompt_mib * (1 << 20)), seed=0)
    kinds = ["completion", "chat"] if args.kind == "both" else [args.kind]
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client, \
            httpx.AsyncClient(timeout=30) as health_client:
        done, latencies = asyncio.Event(), []
        health = asyncio.create_task(poll_health(health_client, url, done, latencies))
        await asyncio.sleep(1.0)
        bodies = [request_body(kinds[i % len(kinds)], prompt) for i in range(args.concurrency)]
        answers = await asyncio.gather(*(client.post(url + path, json=body) for path, body in bodies))
        await asyncio.sleep(1.0)
        done.set()
        await health
    statuses = collections.Counter(answer.status_code for answer in answers)
    return statuses, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-mib", type=float, default=3.9)
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--kind", choices=("completion", "chat", "both"), default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        process, url, pids = start_up(args.model, log_dir)
        router_pid = pids["router"]
        try:
            time.sleep(3.0)  # past start-up's own allocations
            baseline = rss_mib(router_pid)
            sampler = RssSampler(router_pid)
            sampler.start()
            started = time.perf_counter()
            statuses, latencies = asyncio.run(burst(url, args))
            took = time.perf_counter() - started
            sampler.stopped.set()
            time.sleep(args.settle_s)
            after = rss_mib(router_pid)
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(f"router RSS: baseline {baseline:.0f} MiB, peak {sampler.peak:.0f} MiB ({sampler.peak / baseline:.2f}x), "
          f"{args.settle_s:g}s after {after:.0f} MiB ({after / baseline:.2f}x)")
    print(f"{args.concurrency} requests of {args.prompt_mib:g} MiB ({args.kind}) in {took:.1f}s: "
          f"{dict(sorted(statuses.items()))}")
    print(f"/health: {len(latencies)} probes, max {max(latencies):.3f}s, median {sorted(latencies)[len(latencies) // 2]:.3f}s")


if __name__ == "__main__":
    main()
