"""Request-supplied chat templates (--allow-request-chat-template) rendered in worker processes
(router/template_worker.py) that are killed at the time limit: a template is code, and a loop bomb in a
thread could not be stopped (it kept its CPU after its 400). A small pool started with the router, one
render at a time per worker; a killed or dead worker is replaced at once. Blocking: called from a
preprocessing thread. The worker machinery is engine/grammar_sandbox.py's."""

from __future__ import annotations

import logging
import math
import queue
import sys
from typing import Any

from pdserve.engine.grammar_sandbox import SandboxConfig, WorkerDied, _Worker
from pdserve.engine.grammar_worker import frame
from pdserve.router.errors import InvalidRequest, PreprocessingBusy

log = logging.getLogger("pdserve.router.template_sandbox")

# a render is stopped at this share of --preprocess-timeout, so its thread is free again before the
# preprocessor's own limit answers the request
KILL_AT_SHARE = 0.8


class TemplateTimeout(InvalidRequest):
    code = "preprocessing_timeout"


class TemplateSandbox:
    def __init__(self, model: str, preprocess_timeout_s: float, num_workers: int = 2,
                 memory_bytes: int = 4 << 30) -> None:
        self.model = model
        self.limit_s = preprocess_timeout_s
        self.config = SandboxConfig(num_workers=num_workers, timeout_s=KILL_AT_SHARE * preprocess_timeout_s,
                                    cpu_s=max(1, math.ceil(preprocess_timeout_s)), memory_bytes=memory_bytes)
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        for _ in range(num_workers):  # started now: a worker loads the tokenizer for seconds
            self._idle.put(self._start())
        self.num_kills = 0

    def _start(self) -> _Worker:
        return _Worker(self.config, [sys.executable, "-m", "pdserve.router.template_worker", self.model,
                                     str(self.config.memory_bytes), str(self.config.cpu_s)])

    def render(self, conversation: list[dict[str, Any]], **options: Any) -> str:
        """render_chat(tokenizer, conversation, **options) in a worker; InvalidRequest for a template that fails
        or passes the time limit (its worker killed), PreprocessingBusy when no worker could start."""
        worker = self._idle.get()
        try:
            if not worker.alive():
                worker = self._start()
            self._wait_started(worker)
            answer = self._ask(worker, {"conversation": conversation, "options": options})
        except WorkerDied as exc:
            worker.kill()
            worker = self._start()
            self.num_kills += 1
            log.warning("a request's chat template was stopped: its render %s", exc)
            if exc.lasting and "CPU" not in str(exc):
                raise InvalidRequest("the request's chat_template crashed the process rendering it: send a simpler "
                                     "template", param="chat_template") from None
            raise TemplateTimeout(
                f"rendering the request's chat_template took longer than the server's limit of {self.limit_s:g}s "
                f"(it was stopped): send a simpler template (operators: --preprocess-timeout)",
                param="chat_template") from None
        finally:
            self._idle.put(worker)
        if "problem" in answer:
            raise InvalidRequest(answer["problem"], param=answer.get("field") or "messages")
        return answer["text"]

    def wait_started(self) -> None:
        """Until every idle worker has loaded the tokenizer (or failed to: logged, replaced on first use)."""
        with self._idle.mutex:
            workers = list(self._idle.queue)
        for worker in workers:
            try:
                self._wait_started(worker)
            except PreprocessingBusy:
                log.warning("a chat template renderer process (pid %d) did not start: the router's "
                            "--allow-request-chat-template requests start another when they come", worker.pid)

    def _wait_started(self, worker: _Worker) -> None:
        if worker.ready:
            return
        try:
            worker._read_frame(self.config.start_timeout_s, "to start")
        except WorkerDied:
            worker.kill()
            raise PreprocessingBusy("the chat template renderer process did not start: retry later (operators: "
                                    "the router's log says why)") from None
        worker.ready = True

    def _ask(self, worker: _Worker, job: dict) -> dict:
        try:
            worker.process.stdin.write(frame(job))
            worker.process.stdin.flush()
        except OSError as exc:  # BrokenPipeError: it had died
            raise WorkerDied("ended before it rendered") from exc
        return worker._read_frame(self.config.timeout_s, "to render")

    def worker_pids(self) -> list[int]:
        with self._idle.mutex:
            return [worker.pid for worker in self._idle.queue if worker.alive()]

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
