"""Router overhead: what one pdserve router process adds on top of the engine it routes to.

    python experiments/router_overhead.py [--model DIR] [--num-requests 60] [--max-tokens 8] [--prompt-len 32]
                                    [--streams 32 128] [--stream-tokens 256] [--baseline-python PY] [--with-floor]

1. Latency. One decode engine (colocated, the tiny demo model unless --model) and one router given
   its address. The same greedy request (prompt token ids, ignore_eos) is sent alternately
     direct  GenerateRequest on the engine's control socket (a DEALER, as the router does), and
     router  POST /v1/completions over HTTP (non-streaming; and streaming, for the first token), on one
             keep-alive connection of the standard library's http.client (--client httpx for httpx),
   --num-requests times each, one at a time. Overhead = router - direct, median and p99 of the
   end-to-end latency and of the time to first token; and the router process's CPU time per request
   (which other load on the machine changes far less than latencies). --baseline-python PY adds the
   router of another checkout (PY = its venv's python) to the same rounds: an A/B in which both routers
   see the same machine state, with the median of router - baseline per round. --with-floor does the same
   with the bare relay (the floor, below): router - floor per round is what pdserve's own request path costs.
2. Relay throughput. A synthetic engine process answers GenerateRequest by streaming --stream-tokens
   tokens per request as fast as it can (one TokenDelta per token; no model), so the router is the
   bottleneck. N concurrent streaming HTTP clients (raw asyncio connections, one process) read
   the streams; the figures are streamed tokens per second relayed by the router (detokenized,
   SSE-framed) for each N, and tokens per CPU second the router process spent (its capacity per
   core, less sensitive to what else runs on the machine).
All processes share the machine: the client and the synthetic engine compete with the router for CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

try:
    import httpx
except ImportError as exc:  # not a dependency of a plain install
    raise ImportError('the router overhead benchmark needs httpx: pip install "pdserve[bench]"') from exc

from pdserve.control.messages import (
    Abort,
    DescribeRequest,
    EngineStats,
    GenerateRequest,
    Register,
    StatsRequest,
    TokenDelta,
)
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.planner.profile.served import process_cpu_s

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300


# ---- processes ----

def start(command: list[str], log_path: Path, cpus: set[int] | None = None,
          this_checkout: bool = True) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start a pdserve component (on `cpus` with as many torch threads, as `pdserve up --pin-cpus` does)
    and wait for its PDSERVE_READY line. this_checkout=False: the interpreter's own pdserve (another checkout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)} if this_checkout else dict(os.environ)
    if cpus:
        env["OMP_NUM_THREADS"] = str(len(cpus))
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                               env=env, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith("PDSERVE_READY"):
            return process, dict(item.split("=", 1) for item in line.split()[1:])
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"{command[3:5]} did not start:\n{log_path.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def wait_routable(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"router at {url} never routed to its engine")


def start_bare_relay(decode_address: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    process, ready = start([sys.executable, str(Path(__file__).with_name("bare_relay.py")), "--decode-address", decode_address],
                           log_dir / "bare_relay.log")
    wait_routable(ready["url"])
    return process, ready["url"]


def start_router(model: str, decode_address: str, log_dir: Path,
                 python: str | None = None) -> tuple[subprocess.Popen, str]:
    """pdserve's router on this checkout, or on `python`'s own pdserve (another checkout, for an A/B)."""
    process, ready = start([python or sys.executable, "-m", "pdserve", "router", "--model", model, "--port", "0",
                            "--registration-address", "none", "--decode-address", decode_address,
                            "--log-level", "warning",
                            "--insecure"],  # loopback only; the direct calls measured against it are plaintext too
                           log_dir / ("baseline-router.log" if python else "router.log"), this_checkout=python is None)
    wait_routable(ready["url"])
    return process, ready["url"]


# ---- 1. latency ----

def direct_request(client: ClientSocket, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, end-to-end) of one request sent straight to the engine."""
    start_time = time.perf_counter()
    client.send(GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    first = None
    while True:
        received = client.recv(timeout=60)
        if received is None:
            raise TimeoutError("the engine did not answer within 60s")
        msg = received.msg
        if isinstance(msg, TokenDelta) and msg.request_id == request_id:
            if first is None and msg.token_ids:
                first = time.perf_counter() - start_time
            if msg.finish_reason is not None:
                if msg.finish_reason == "error":
                    raise RuntimeError(msg.error)
                return first, time.perf_counter() - start_time


class LeanClient:
    """One keep-alive HTTP/1.1 connection through the standard library's http.client. The figures are the
    router's, so the client should cost little: on this machine httpx spends ~0.6 ms more per request than
    http.client against a bare ASGI app (0.83 against 0.22 ms), which would count as router overhead."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=60)

    def _post(self, body: dict) -> http.client.HTTPResponse:
        encoded = json.dumps(body).encode()
        try:
            self.connection.request("POST", "/v1/completions", body=encoded, headers={"Content-Type": "application/json"})
            response = self.connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.connection.close()  # the server closed an idle keep-alive connection: open a new one
            self.connection.request("POST", "/v1/completions", body=encoded, headers={"Content-Type": "application/json"})
            response = self.connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the router answered {response.status}: {response.read()[:500]!r}")
        return response

    def complete(self, body: dict) -> None:
        self._post(body).read()

    def stream_lines(self, body: dict) -> Iterator[bytes]:
        response = self._post(body)
        while line := response.readline():
            yield line

    def close(self) -> None:
        self.connection.close()


class HttpxClient:
    """The same requests through httpx (`--client httpx`: how the figures before issue #17 were taken)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)

    def complete(self, body: dict) -> None:
        self.http.post("/v1/completions", json=body).raise_for_status()

    def stream_lines(self, body: dict) -> Iterator[bytes]:
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                yield line.encode()

    def close(self) -> None:
        self.http.close()


CLIENTS = {"http.client": LeanClient, "httpx": HttpxClient}


def router_request(client: LeanClient | HttpxClient, prompt: list[int], max_tokens: int) -> float:
    start_time = time.perf_counter()
    client.complete({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return time.perf_counter() - start_time


def router_first_token(client: LeanClient | HttpxClient, prompt: list[int], max_tokens: int) -> float:
    start_time = time.perf_counter()
    first = None
    for line in client.stream_lines({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                     "ignore_eos": True, "stream": True, "return_token_ids": True}):
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - start_time
    return first


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def engine_cpus(args: argparse.Namespace) -> set[int] | None:
    """The decode engine's core (the last one by default), so that its torch threads, which spin between
    operations, do not take the router's core: a deployed router does not share its cores with an engine.
    None (--engine-cpu -1, or one core only): the engine shares every core, with torch's default threads."""
    available = sorted(os.sched_getaffinity(0))
    if args.engine_cpu == -1 or len(available) < 2:
        return None
    core = available[-1] if args.engine_cpu is None else args.engine_cpu
    if core not in available:
        raise SystemExit(f"--engine-cpu {core} is not one of this process's cores {available}")
    return {core}


def measure_latency(model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, dict[str, float]]:
    """Requests sent one at a time, in rounds: direct, then each front end (whole, then streamed). With
    --baseline-python, a second router from another checkout is measured in the same rounds, so that both
    see the same machine: on a shared VM the overhead moves with the machine's state more than with the code."""
    engine, ready = start([sys.executable, "-m", "pdserve", "decode", "--model", model, "--dtype", "float32",
                           "--log-level", "WARNING", "--insecure"], log_dir / "decode.log", engine_cpus(args))
    front_ends: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        if args.router == "bare":
            front_ends["router"] = start_bare_relay(ready["control"], log_dir)
        else:
            front_ends["router"] = start_router(model, ready["control"], log_dir)
        if args.baseline_python:
            front_ends["baseline"] = start_router(model, ready["control"], log_dir, args.baseline_python)
        if args.with_floor and args.router != "bare":
            front_ends["floor"] = start_bare_relay(ready["control"], log_dir)
        samples = _latency_rounds(ready["control"], front_ends, args)
    finally:
        for process, _ in front_ends.values():
            stop(process)
        stop(engine)
    return _latency_summary(samples, list(front_ends), args)


def _latency_rounds(engine_address: str, front_ends: dict[str, tuple[subprocess.Popen, str]],
                    args: argparse.Namespace) -> dict[str, list[float]]:
    prompt = [(7 * i) % 900 + 10 for i in range(args.prompt_len)]
    samples: dict[str, list[float]] = {"direct_e2e": [], "direct_ttft": []}
    cpu_before = {name: process_cpu_s(process.pid) for name, (process, _) in front_ends.items()}
    with ClientSocket(engine_address) as client, ExitStack() as clients:
        http = {name: clients.enter_context(closing(CLIENTS[args.client](url)))
                for name, (_, url) in front_ends.items()}
        ids = (f"bench-{i}" for i in itertools.count())
        for i in range(args.num_requests + args.warmup):
            ttft, e2e = direct_request(client, next(ids), prompt, args.max_tokens)
            measured = {"direct_ttft": ttft, "direct_e2e": e2e}
            for name in list(http)[::-1 if i % 2 else 1]:  # alternate which front end goes first
                connection = http[name]
                measured[f"{name}_e2e"] = router_request(connection, prompt, args.max_tokens)
                measured[f"{name}_ttft"] = router_first_token(connection, prompt, args.max_tokens)
            if i >= args.warmup:
                for key, value in measured.items():
                    samples.setdefault(key, []).append(value * 1000)
    num_routed = 2 * (args.num_requests + args.warmup)  # one whole and one streamed request per round
    for name, (process, _) in front_ends.items():
        samples[f"{name}_cpu_per_request"] = [(process_cpu_s(process.pid) - cpu_before[name]) * 1000 / num_routed]
    return samples


def _latency_summary(samples: dict[str, list[float]], names: list[str],
                     args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median and p99 of each series; overhead = front end - direct of each round (back to back, so shared
    machine noise cancels more), and router - baseline and router - floor of each round."""
    for name in names:
        for kind in ("e2e", "ttft"):
            samples[f"overhead_{kind}" if name == "router" else f"{name}_overhead_{kind}"] = [
                r - d for r, d in zip(samples[f"{name}_{kind}"], samples[f"direct_{kind}"])]
    for other in ("baseline", "floor"):
        if other in names:
            for kind in ("e2e", "ttft"):
                samples[f"router_minus_{other}_{kind}"] = [
                    r - b for r, b in zip(samples[f"router_{kind}"], samples[f"{other}_{kind}"])]
    return {name: {"median": statistics.median(values), "p99": percentile(values, 0.99)}
            for name, values in samples.items()}


# ---- 2. relay throughput ----

def synthetic_engine(tokens: list[int]) -> None:
    """A decode engine without a model: every step sends one token to every open request."""
    server = ServerSocket("tcp://127.0.0.1:0")
    print(f"PDSERVE_READY role=decode engine_id=synthetic control={server.address}", flush=True)
    active: dict[str, list] = {}  # request id -> [peer, tokens left, position]
    while True:
        routed = server.recv(timeout=0 if active else 0.01)
        while routed is not None:
            _answer(server, routed, active)
            routed = server.recv(timeout=0)
        for request_id, state in list(active.items()):
            peer_id, left, position = state
            last = left == 1
            server.send(peer_id, TokenDelta(request_id=request_id, token_ids=(tokens[position % len(tokens)],),
                                            finish_reason="length" if last else None))
            state[1], state[2] = left - 1, position + 1
            if last:
                del active[request_id]


def _answer(server: ServerSocket, routed, active: dict) -> None:
    msg, peer_id = routed.msg, routed.peer_id
    if isinstance(msg, DescribeRequest):
        server.send(peer_id, Register(engine_id="synthetic", role="decode", control_address=server.address,
                                      block_size=16, max_model_len=1 << 20, vocab_size=1 << 20))
    elif isinstance(msg, StatsRequest):
        server.send(peer_id, EngineStats(engine_id="synthetic", role="decode", num_waiting=0, num_running=len(active),
                                         kv_blocks_used=0, kv_blocks_total=1, queued_prefill_tokens=0))
    elif isinstance(msg, GenerateRequest):
        active[msg.request_id] = [peer_id, msg.sampling_params.max_tokens, 0]
    elif isinstance(msg, Abort):
        active.pop(msg.request_id, None)


async def _one_stream(host: str, port: int, num_tokens: int) -> int:
    """One streamed completion over a raw connection (a lean client, so the router is what is measured);
    returns the completion tokens of its usage chunk."""
    body = json.dumps({"prompt": [11, 12, 13, 14], "max_tokens": num_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    received = bytearray()
    while chunk := await reader.read(1 << 16):
        received += chunk
    writer.close()
    if b'"completion_tokens":' not in received:  # refused (a 429 or 503) or cut short: counted as failed
        return 0
    usage = received.rsplit(b'"completion_tokens":', 1)[1]
    return int(usage.split(b",", 1)[0])


async def _relay(url: str, num_streams: int, num_tokens: int) -> tuple[int, int, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    await _one_stream(host, int(port), 8)  # warm up
    start_time = time.perf_counter()
    counts = await asyncio.gather(*(_one_stream(host, int(port), num_tokens) for _ in range(num_streams)))
    return sum(counts), counts.count(0), time.perf_counter() - start_time


def measure_relay(model: str, args: argparse.Namespace, log_dir: Path) -> list[dict[str, float]]:
    engine, ready = start([sys.executable, str(Path(__file__).resolve()), "--synthetic-engine", "--model", model],
                          log_dir / "synthetic.log")
    router, url = start_router(model, ready["control"], log_dir)
    rows = []
    try:
        for num_streams in args.streams:
            cpu_before = process_cpu_s(router.pid)
            num_tokens, num_failed, seconds = asyncio.run(_relay(url, num_streams, args.stream_tokens))
            router_cpu = process_cpu_s(router.pid) - cpu_before
            rows.append({"streams": num_streams, "failed": num_failed, "tokens": num_tokens, "seconds": seconds,
                         "tokens_per_s": num_tokens / seconds, "router_cpu_s": router_cpu,
                         "tokens_per_cpu_s": num_tokens / max(router_cpu, 1e-9)})
    finally:
        stop(router)
        stop(engine)
    return rows


# ---- main ----

def text_tokens(model: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).encode(" the quick brown fox jumps over the lazy dog,")


def resolve_model(model: str | None, scratch: Path) -> str:
    if model:
        return model
    from pdserve.demo_model import make_demo_model

    return str(make_demo_model(scratch / "tiny", arch="llama", size="tiny", seed=0))


def report(latency: dict | None, relay: list | None, args: argparse.Namespace) -> None:
    print(f"\nmachine: {os.cpu_count()} CPUs visible, python {sys.version.split()[0]}")
    if latency:
        print(f"\nlatency, ms ({args.num_requests} requests each, prompt {args.prompt_len} tokens, "
              f"{args.max_tokens} generated, one at a time; HTTP client: {args.client}; "
              f"decode engine on {_where(engine_cpus(args))}; front end: {args.router})")
        print("| measure | direct median | router median | direct p99 | router p99 | overhead median | overhead p99 |")
        print("|---|---|---|---|---|---|---|")
        for kind, label in (("e2e", "end to end"), ("ttft", "first token")):
            direct, routed, added = latency[f"direct_{kind}"], latency[f"router_{kind}"], latency[f"overhead_{kind}"]
            print(f"| {label} | {direct['median']:.2f} | {routed['median']:.2f} | {direct['p99']:.2f} | "
                  f"{routed['p99']:.2f} | {added['median']:.2f} | {added['p99']:.2f} |")
        print("(overhead = router - direct of each back-to-back pair)")
        print(f"router CPU time per request (user + system, whole and streamed alike): "
              f"{latency['router_cpu_per_request']['median']:.2f} ms")
        for other, title in (("baseline", f"the router of {args.baseline_python}'s pdserve"),
                             ("floor", "the bare relay (experiments/bare_relay.py, the floor)")):
            if f"{other}_e2e" in latency:
                _report_same_rounds(latency, other, title)
    if relay:
        print(f"\nrelay throughput (synthetic engine, {args.stream_tokens} tokens per stream)")
        print("| concurrent streams | failed | tokens | seconds | streamed tokens/s | router CPU s | "
              "tokens per router CPU s |")
        print("|---|---|---|---|---|---|---|")
        for row in relay:
            print(f"| {row['streams']} | {row['failed']} | {row['tokens']} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} | "
                  f"{row['router_cpu_s']:.2f} | {row['tokens_per_cpu_s']:.0f} |")


def _report_same_rounds(latency: dict, other: str, title: str) -> None:
    print(f"\n{other}: {title}, in the same rounds (ms)")
    print(f"| measure | {other} overhead median | {other} overhead p99 | router - {other} median |")
    print("|---|---|---|---|")
    for kind, label in (("e2e", "end to end"), ("ttft", "first token")):
        added, diff = latency[f"{other}_overhead_{kind}"], latency[f"router_minus_{other}_{kind}"]
        print(f"| {label} | {added['median']:.2f} | {added['p99']:.2f} | {diff['median']:+.2f} |")
    print(f"{other} CPU time per request: {latency[f'{other}_cpu_per_request']['median']:.2f} ms")


def _where(cpus: set[int] | None) -> str:
    return "every core" if cpus is None else f"core {','.join(map(str, sorted(cpus)))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/router_overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: a tiny demo model)")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--client", choices=sorted(CLIENTS), default="http.client",
                        help="HTTP client of the latency part (httpx costs ~0.6 ms per request more on its own)")
    parser.add_argument("--engine-cpu", type=int, default=None,
                        help="the decode engine's core in the latency part, with one torch thread "
                             "(default: the last core; -1: no pinning, the engine shares every core)")
    parser.add_argument("--router", choices=("pdserve", "bare"), default="pdserve",
                        help="what the latency part measures: pdserve's router, or experiments/bare_relay.py, the fewest "
                             "steps a Python relay can take (the floor; no relay part then)")
    parser.add_argument("--baseline-python", default=None,
                        help="the python of another checkout (e.g. its venv's bin/python): its router is measured in "
                             "the same rounds as this one's, for an A/B that both see the same machine state")
    parser.add_argument("--with-floor", action="store_true",
                        help="also measure the bare relay (the floor) in the same rounds: router - floor per round")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-relay", action="store_true")
    parser.add_argument("--synthetic-engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_python and not os.access(args.baseline_python, os.X_OK):
        parser.error(f"--baseline-python {args.baseline_python} is not an executable python: give the other "
                     "checkout's interpreter, e.g. /path/to/checkout/.venv/bin/python")
    if args.synthetic_engine:
        synthetic_engine(text_tokens(args.model))
        return 0
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as scratch:
        log_dir = Path(scratch)
        model = resolve_model(args.model, log_dir)
        latency = None if args.skip_latency else measure_latency(model, args, log_dir)
        relay = None if args.skip_relay or args.router == "bare" else measure_relay(model, args, log_dir)
        report(latency, relay, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
