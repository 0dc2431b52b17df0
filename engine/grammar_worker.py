"""`python -m pdserve.engine.grammar_worker MEMORY_BYTES CPU_S STACK_BYTES`: one grammar-check worker of
engine/grammar_sandbox.py. Reads jobs from stdin and writes verdicts to stdout, one at a time, under an
address-space limit and a CPU-time limit per job, compiling on a thread with a small fixed stack: a
compiler crash ends this process, never its parent.

Frames: a 4-byte big-endian length, then UTF-8 JSON. First {"ready": true} once imported; then per job
{"kind", "spec"} in, the verdict {"problem": text or null} out."""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading

_LENGTH = struct.Struct(">I")


def read_frame(stream) -> dict | None:
    """The next frame's JSON; None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    body = stream.read(_LENGTH.unpack(head)[0])
    return json.loads(body)


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return _LENGTH.pack(len(body)) + body


def grammar_problem(kind: str, spec: str) -> str | None:
    """What the compiler says is wrong with the constraint; None when it compiles."""
    from llguidance import LLMatcher

    from pdserve.control.errors import InvalidRequestError
    from pdserve.engine.grammar import grammar_of

    try:
        problem = LLMatcher.validate_grammar(grammar_of(kind, spec), None)
    except InvalidRequestError as exc:
        return str(exc)
    except (TypeError, ValueError) as exc:
        return f"the structured output's {kind} does not compile: {exc}"
    if problem:
        return f"the structured output's {kind} does not compile: {problem.strip()[:1000]}"
    return None


def _judge(job: dict, cpu_s: int) -> dict:
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_s, resource.RLIM_INFINITY))  # SIGXCPU past it
    verdict: dict = {}

    def work() -> None:
        verdict["problem"] = grammar_problem(job["kind"], job["spec"])

    compiler = threading.Thread(target=work, name="pdserve-grammar-check")
    compiler.start()
    compiler.join()
    if "problem" not in verdict:  # the thread raised: an error of the checker, not of the grammar
        verdict["problem"] = f"the structured output's {job['kind']} could not be checked"
    return verdict


def main(argv: list[str]) -> None:
    memory_bytes, cpu_s, stack_bytes = (int(value) for value in argv)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    threading.stack_size(stack_bytes)
    # everything a job needs, imported once before the ready frame: a worker that cannot load the compiler
    # (too little memory) did not start, and no constraint is blamed for it
    from llguidance import LLMatcher  # noqa: F401

    from pdserve.control.errors import InvalidRequestError  # noqa: F401
    from pdserve.engine.grammar import grammar_of  # noqa: F401

    jobs, verdicts = sys.stdin.buffer, sys.stdout.buffer
    verdicts.write(frame({"ready": True}))
    verdicts.flush()
    while (job := read_frame(jobs)) is not None:
        verdicts.write(frame(_judge(job, cpu_s)))
        verdicts.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
