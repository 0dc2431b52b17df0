"""How much earlier the first token leaves the prefill engine than the decode engine has the prompt's KV.

    python -m pdserve.bench.first_token_lead [--model DIR] [--num-requests 8] [--prompt-lens 256 1024]

One prefill and one decode engine process (pdserve.local_cluster, KV sent after the prefill unless
--kv-streaming on), one request at a time after one warmup per length. Both engines run with DEBUG
logs; the lead of a request is the decode engine's "KV of <id> verified at <t>" minus the prefill
engine's "first token of <id> published at <t>" (time.time() of one host). Before issue #17 the first
token reached the router only after that moment, plus the decode engine's next loop round.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from pdserve.local_cluster import Driver, EngineProcess

PUBLISHED = r"first token of (\S+) published at ([\d.]+)"
VERIFIED = r"KV of (\S+) verified at ([\d.]+)"


def log_times(log: str, pattern: str) -> dict[str, float]:
    return {match[1]: float(match[2]) for match in re.finditer(pattern, log)}


def measure(driver: Driver, prefill: EngineProcess, decode: EngineProcess, prompt_len: int, num_requests: int,
            vocab_size: int) -> list[float]:
    """Leads in ms of num_requests requests of prompt_len tokens (after one warmup)."""
    request_ids = [f"len{prompt_len}-{i}" for i in range(num_requests + 1)]
    for i, request_id in enumerate(request_ids):
        prompt = [(13 * j + i) % (vocab_size - 10) + 10 for j in range(prompt_len)]
        driver.submit(request_id, prompt, temperature=0.0, max_tokens=2, ignore_eos=True)
        driver.collect([request_id])
    published, verified = log_times(prefill.log(), PUBLISHED), log_times(decode.log(), VERIFIED)
    return [(verified[r] - published[r]) * 1000 for r in request_ids[1:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.first_token_lead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the SmolLM-135M-shaped demo model)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--kv-streaming", choices=["auto", "on", "off"], default="auto")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-lead-") as scratch:
        log_dir = Path(scratch)
        model = args.model
        if model is None:
            from pdserve.demo_model import make_demo_model

            model = str(make_demo_model(log_dir / "demo", arch="llama", size="small", seed=0))
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model).vocab_size
        engine_args = ("--log-level", "DEBUG", "--max-num-batched-tokens", str(max(2048, *args.prompt_lens)))
        prefill = EngineProcess("prefill", model, *engine_args, "--kv-streaming", args.kv_streaming, log_dir=log_dir)
        decode = EngineProcess("decode", model, *engine_args, *prefill.kv_peer_args(), log_dir=log_dir)
        driver = Driver(decode, prefill)
        try:
            print("| prompt | first token ahead of the verified KV, median | min | max |")
            print("| --- | --- | --- | --- |")
            for prompt_len in args.prompt_lens:
                leads = measure(driver, prefill, decode, prompt_len, args.num_requests, vocab_size)
                print(f"| {prompt_len} tokens | {statistics.median(leads):.1f} ms | {min(leads):.1f} ms | "
                      f"{max(leads):.1f} ms |")
        finally:
            driver.close()
            prefill.stop()
            decode.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
