"""Engine processes on this machine and a small driver that talks to them the way the router does.

Used by tests and benchmarks to run real `pdserve prefill|decode` processes on loopback."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.control.messages import (
    Abort,
    EngineStats,
    GenerateRequest,
    PrefillRequest,
    PromptLogprobs,
    StatsRequest,
    TokenDelta,
)
from pdserve.control.prompt_logprobs import PromptLogprobsAssembler
from pdserve.control.prompt_logprobs import read as read_prompt_logprobs
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120


class ChildProcess:
    """A pdserve component run as a child process (stderr to log_path) whose start waits for its
    PDSERVE_READY line."""

    process: subprocess.Popen
    log_path: Path
    _terminated = False  # terminate() has sent SIGTERM

    def launch(self, command: list[str], what: str, env: dict | None = None) -> dict[str, str]:
        """Start `command`; the key=value pairs of its PDSERVE_READY line (RuntimeError with its log if none)."""
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                 **(env or {})})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith("PDSERVE_READY"):
                    return dict(item.split("=", 1) for item in line.split()[1:])
            if self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{what} did not start:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM, once: stop() after it waits for the exit without signalling again."""
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.terminate()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text()


class EngineProcess(ChildProcess):
    """`python -m pdserve <role> ...` as a child process; waits for its PDSERVE_READY line. `module` runs
    another entry point with the same command line (tests: one that injects faults first); `launcher`
    goes before it (tests: `ip netns exec NS`, another host). Without --curve-dir in args it runs
    --insecure: plaintext on loopback, as tests and benchmarks here need."""

    def __init__(self, role: str, model_dir: str, *args: str, env: dict | None = None, log_dir: Path,
                 module: str = "pdserve", launcher: tuple[str, ...] = ()) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        trust = () if "--curve-dir" in args or "--insecure" in args else ("--insecure",)
        command = [*launcher, sys.executable, "-m", module, role, "--model", model_dir, "--dtype", "float32",
                   *args, *trust]
        self.addresses = self.launch(command, f"{role} engine", env)

    def kv_peer_args(self) -> tuple[str, ...]:
        """A prefill engine's KV address as a decode engine's `--kv-peer` arguments: a decode engine
        without a router pulls KV only from prefill engines it was given."""
        return ("--kv-peer", self.addresses["kv"])


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token, when the request asked
    finish_reason: str | None = None
    error: str | None = None
    # with prompt_logprobs: [None, {token id: (logprob, rank)}, ...] as the first engine that sent them did
    prompt_logprobs: list | None = None
    prompt_logprobs_from: str | None = None  # "prefill" or "decode"


class Driver:
    """Sends requests the way the router will: PrefillRequest to P and GenerateRequest to D at once."""

    def __init__(self, decode: EngineProcess, prefill: EngineProcess | None = None, curve=None) -> None:
        """curve: a CurveClientConfig when the engines run with --curve-dir."""
        self.engines = (decode, prefill)
        self.decode = ClientSocket(decode.addresses["control"], curve=curve)
        self.prefill = ClientSocket(prefill.addresses["control"], curve=curve) if prefill else None
        self.prefill_kv = prefill.addresses["kv"] if prefill else None
        self._prompt_lengths: dict[str, int] = {}
        self._assemblers: dict[str, PromptLogprobsAssembler] = {}

    def submit(self, request_id: str, prompt: list[int], remote: bool = True, **sampling) -> None:
        """sampling: SamplingParams keyword arguments."""
        params = SamplingParams(**sampling)
        self._prompt_lengths[request_id] = len(prompt)
        use_prefill = remote and self.prefill is not None
        if use_prefill:
            self.prefill.send(PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
        self.decode.send(GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                         prefill_kv_address=self.prefill_kv if use_prefill else None))

    def collect(self, request_ids, timeout_s: float = 60.0) -> dict[str, Result]:
        results = {request_id: Result() for request_id in request_ids}
        deadline = time.monotonic() + timeout_s
        while any(r.finish_reason is None for r in results.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still open after {timeout_s}s: "
                                   f"{[k for k, r in results.items() if r.finish_reason is None]}")
            for client in filter(None, (self.decode, self.prefill)):
                received = client.recv(timeout=0.01)
                if received is not None and isinstance(received.msg, PromptLogprobs):
                    self._gather_prompt_logprobs(results[received.msg.request_id], received,
                                                 "prefill" if client is self.prefill else "decode")
                    continue
                if client is self.prefill and received is not None and not (
                        isinstance(received.msg, TokenDelta) and received.msg.finish_reason == "error"):
                    continue  # the prefill engine's first token comes again from the decode engine
                if received is not None and isinstance(received.msg, TokenDelta):
                    result = results[received.msg.request_id]
                    result.token_ids.extend(received.msg.token_ids)
                    result.logprobs.extend(dict(entry) for entry in received.msg.logprobs)
                    if received.msg.finish_reason is not None:
                        result.finish_reason, result.error = received.msg.finish_reason, received.msg.error
        return results

    def _gather_prompt_logprobs(self, result: Result, received, engine: str) -> None:
        """Keep the first engine's set whole (the router keeps the first complete set too)."""
        msg = received.msg
        if result.prompt_logprobs_from is None:
            result.prompt_logprobs_from = engine
            self._assemblers[msg.request_id] = PromptLogprobsAssembler(self._prompt_lengths[msg.request_id])
        if engine == result.prompt_logprobs_from:
            assembler = self._assemblers[msg.request_id]
            assembler.add(msg, read_prompt_logprobs(msg, received.frames))
            result.prompt_logprobs = assembler.result

    def generate(self, prompts: list[list[int]], remote: bool = True, prefix: str = "r", **sampling):
        ids = [f"{prefix}{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.submit(request_id, prompt, remote, **sampling)
        results = self.collect(ids)
        return [results[request_id] for request_id in ids]

    def abort(self, request_id: str) -> None:
        self.decode.send(Abort(request_id=request_id, reason="client went away"))
        if self.prefill is not None:
            self.prefill.send(Abort(request_id=request_id, reason="client went away"))

    @staticmethod
    def _stats(client: ClientSocket) -> EngineStats:
        client.send(StatsRequest())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            received = client.recv(timeout=0.1)
            if received is not None and isinstance(received.msg, EngineStats):
                return received.msg
        raise TimeoutError("no EngineStats within 10s")

    def decode_stats(self) -> EngineStats:
        return self._stats(self.decode)

    def prefill_stats(self) -> EngineStats:
        return self._stats(self.prefill)

    def wait_idle(self, timeout_s: float = 30.0) -> tuple[EngineStats, EngineStats | None]:
        """Poll both engines until no KV block is used (delayed frees settle after acks)."""
        deadline = time.monotonic() + timeout_s
        while True:
            decode = self.decode_stats()
            prefill = self.prefill_stats() if self.prefill else None
            if decode.kv_blocks_used == 0 and (prefill is None or prefill.kv_blocks_used == 0):
                return decode, prefill
            if time.monotonic() > deadline:
                return decode, prefill
            time.sleep(0.05)

    def decode_log(self) -> str:
        return self.engines[0].log()

    def prefill_log(self) -> str:
        return self.engines[1].log()

    def close(self) -> None:
        for client in filter(None, (self.decode, self.prefill)):
            client.close()
