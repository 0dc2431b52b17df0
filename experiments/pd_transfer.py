"""KV transfer against prefill time, on real prefill and decode processes over loopback.

    python experiments/pd_transfer.py [--model DIR] [--prompt-lens 1024 4096] [--repeats 3] [--device cuda]

For each prompt length, time to first token (TTFT, seen by the client) in three modes, in one run:
  local      the decode engine prefills the prompt itself (no transfer: the baseline)
  sent-after the prefill engine computes the prompt, then sends all its KV (--kv-streaming off)
  streamed   the prefill engine sends each layer's KV as soon as it is computed (--kv-streaming on)
The prefill engine also times each transfer's exposed part: from the moment its prompt is computed to
the decode engine's KVAck (all layers arrived and verified). That is the transfer time compute did not
hide; hidden by streaming = 1 - exposed(streamed) / exposed(sent-after). TTFT differences against
local prefill show the same on a GPU, but on a CPU they drown in prefill-time noise. Every prompt is new to both engines (no prefix-cache hits). Default model: the SmolLM-135M-shaped demo
Llama with max_position_embeddings 8192 (so a 4k prompt fits), built once under $PDSERVE_CACHE.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.control.messages import EngineStats
from pdserve.local_cluster import Driver, EngineProcess

ENGINE_ARGS = ("--max-num-batched-tokens", "2048", "--log-level", "WARNING")
CUDA_KV_BLOCKS = "2048"  # per engine: the three engines share one GPU, so none may size itself to the free memory


def bench_model() -> str:
    from pdserve.demo_model import cache_dir, make_demo_model

    path = cache_dir() / "bench-models" / "llama-small-8k"
    if not (path / "config.json").is_file():
        make_demo_model(path, "llama", "small", config_overrides={"max_position_embeddings": 8192})
    return str(path)


def time_to_first_token(driver: Driver, request_id: str, prompt: list[int], remote: bool) -> float:
    started = time.perf_counter()
    driver.submit(request_id, prompt, remote, temperature=0.0, max_tokens=2, ignore_eos=True)
    first = None
    while True:
        received = driver.decode.recv(timeout=0.001)
        if received is None:
            continue
        delta = received.msg
        if first is None and getattr(delta, "token_ids", ()):
            first = time.perf_counter() - started
        if getattr(delta, "finish_reason", None):
            if delta.finish_reason != "length":
                raise RuntimeError(f"{request_id} ended with {delta.finish_reason}: {delta.error}")
            return first


def exposed_transfer_s(driver: Driver, before: EngineStats, timeout_s: float = 10.0) -> float:
    """Seconds the prefill engine reports for the transfer acked since `before` (it acks before D's
    first token, but P may read the ack a little later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = driver.prefill_stats()
        if stats.num_kv_transfers > before.num_kv_transfers:
            return stats.kv_transfer_seconds - before.kv_transfer_seconds
        time.sleep(0.01)
    raise RuntimeError("the prefill engine reported no acked transfer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: all three engines on the same GPU")
    args = parser.parse_args()
    model = args.model or bench_model()
    from pdserve.engine.config import ModelConfig

    bytes_per_token = ModelConfig.from_hf(model, dtype="float32").kv_bytes_per_token
    logs = Path(tempfile.mkdtemp(prefix="pd-transfer-"))
    engine_args = (*ENGINE_ARGS, "--device", args.device)
    if args.device.startswith("cuda"):
        engine_args += ("--num-kv-blocks", CUDA_KV_BLOCKS)
    streamed = EngineProcess("prefill", model, *engine_args, "--kv-streaming", "on", log_dir=logs)
    after = EngineProcess("prefill", model, *engine_args, "--kv-streaming", "off", "--engine-id", "prefill-1",
                          log_dir=logs)
    decode = EngineProcess("decode", model, *engine_args, "--kv-timeout", "300", *streamed.kv_peer_args(),
                           *after.kv_peer_args(), log_dir=logs)
    drivers = {"streamed": Driver(decode, streamed), "sent-after": Driver(decode, after)}
    local = drivers["streamed"]
    rng = random.Random(0)
    try:
        print(f"model {model}; device {args.device}")
        print(f"{'prompt':>6} {'KV MiB':>7} {'TTFT local s':>13} {'sent-after s':>13} {'streamed s':>11} "
              f"{'exposed after ms':>17} {'exposed streamed ms':>20} {'hidden':>7}")
        for length in args.prompt_lens:
            ttft = {"local": [], "sent-after": [], "streamed": []}
            exposed = {"sent-after": [], "streamed": []}
            for repeat in range(args.repeats):
                for mode in ("local", "sent-after", "streamed"):
                    prompt = [rng.randrange(10, 40000) for _ in range(length)]
                    driver = local if mode == "local" else drivers[mode]
                    before = driver.prefill_stats() if mode != "local" else None
                    ttft[mode].append(time_to_first_token(driver, f"{mode}-{length}-{repeat}", prompt,
                                                          remote=mode != "local"))
                    if mode != "local":
                        exposed[mode].append(exposed_transfer_s(driver, before))
            med = {mode: statistics.median(values) for mode, values in {**ttft, **{
                f"exposed {m}": v for m, v in exposed.items()}}.items()}
            after_s, streamed_s = med["exposed sent-after"], med["exposed streamed"]
            kv_mib = length * bytes_per_token / 2**20
            print(f"{length:>6} {kv_mib:>7.1f} {med['local']:>13.3f} {med['sent-after']:>13.3f} "
                  f"{med['streamed']:>11.3f} {1000 * after_s:>17.1f} {1000 * streamed_s:>20.1f} "
                  f"{1 - streamed_s / after_s:>7.0%}")
    finally:
        for driver in drivers.values():
            driver.close()
        for process in (streamed, after, decode):
            process.stop()


if __name__ == "__main__":
    main()
