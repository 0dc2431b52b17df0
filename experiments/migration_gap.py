"""Stream migration: the gap a stream sees when its decode engine dies mid-way (router/migration.py).

    python experiments/migration_gap.py [--model DIR] [--num-prefill 0] [--streams 4] [--max-tokens 128]
                                        [--signal KILL|STOP] [--heartbeat-timeout 1]

Starts `pdserve up` with two decode engines (the tiny demo model unless --model), streams --streams greedy
completions at once, and once every stream has its third chunk sends --signal to decode-0 (KILL: kill -9; STOP:
SIGSTOP, then SIGCONT when the streams are done). For each stream decode-0 had (its gap straddles the signal)
it prints the gap: the last chunk before the signal to the first after, with the stream's median inter-chunk
time beside it. The gap's parts: noticing the loss (KILL: the connection drops at once; STOP: the heartbeat
timeout), finding the other engine, and its prefill of prompt + the tokens so far.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def start_up(args: argparse.Namespace, log_dir: str) -> tuple[subprocess.Popen, str, dict[str, int]]:
    command = [sys.executable, "-m", "pdserve", "up", "--port", "0", "--log-dir", log_dir, "--num-prefill",
               str(args.num_prefill), "--num-decode", "2", "--max-restarts", "0", "--heartbeat-timeout",
               str(args.heartbeat_timeout), "--insecure", *(["--model", args.model] if args.model else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: dict[str, int] = {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if select.select([process.stdout], [], [], 1.0)[0]:
            line = process.stdout.readline()
            if line.startswith("[pdserve up] ") and " ready (" in line:
                pids[line.split()[2]] = int(line.split(" pid ")[1].split(",")[0])
            if line.startswith("PDSERVE_READY role=up"):
                return process, dict(item.split("=", 1) for item in line.split()[1:])["url"], pids
        if process.poll() is not None:
            break
    raise SystemExit("pdserve up did not become ready")


def read_stream(url: str, model: str, prompt: str, max_tokens: int, times: list[float], started: threading.Semaphore):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if "error" in json.loads(line[6:]):
                    raise SystemExit(f"a stream failed: {line}")
                times.append(time.monotonic())
                if len(times) == 3:
                    started.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prefill", type=int, default=0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="migration-gap-") as log_dir:
        process, url, pids = start_up(args, log_dir)
        try:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            started = threading.Semaphore(0)
            times: list[list[float]] = [[] for _ in range(args.streams)]
            prompts = [f"Stream {i}: def main():\n    " for i in range(args.streams)]
            threads = [threading.Thread(target=read_stream, args=(url, model, p, args.max_tokens, t, started))
                       for p, t in zip(prompts, times)]
            for thread in threads:
                thread.start()
            for _ in threads:
                started.acquire()
            struck = time.monotonic()
            os.kill(pids["decode-0"], getattr(signal, f"SIG{args.signal}"))
            print(f"signal sent at {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}")
            for thread in threads:
                thread.join()
            if args.signal == "STOP":
                os.kill(pids["decode-0"], signal.SIGCONT)
            report(times, struck, args)
            router_log = open(os.path.join(log_dir, "router.log")).read().splitlines()
            print("\n".join(line for line in router_log if "leaves routing" in line or "resumed after" in line))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def report(times: list[list[float]], struck: float, args: argparse.Namespace) -> None:
    print(f"model {args.model or 'the demo model'}, {args.num_prefill}P2D, {args.streams} streams of {args.max_tokens} "
          f"tokens, SIG{args.signal} of decode-0")
    for index, stamps in enumerate(times):
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        median = statistics.median(gaps) if gaps else 0.0
        # the longest wait from the last chunk before the signal on (chunks already on their way may come first)
        first = max([i for i, t in enumerate(stamps) if t <= struck], default=0)
        longest = max(gaps[first:], default=0.0)
        migrated = longest > 2 * median + 0.1
        print(f"  stream {index}: {len(stamps)} chunks, median gap {median * 1000:.1f} ms, longest gap from the "
              f"signal on {longest * 1000:.0f} ms{'  <- migrated' if migrated else ''}")


if __name__ == "__main__":
    main()
