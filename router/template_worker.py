"""`python -m pdserve.router.template_worker MODEL MEMORY_BYTES CPU_S`: one worker of router/template_sandbox.py.
Loads the model's tokenizer once, then renders request-supplied chat templates one at a time (engine/chat.py's
render_chat, as the router renders its own), under an address-space limit and a CPU-time limit per job. Its
parent kills it when a render passes the time limit.

Frames as engine/grammar_worker.py's: {"ready": true} once loaded; then per job {"conversation", "options"} in,
{"text"} or {"problem", "field"} out."""

from __future__ import annotations

import os
import resource
import sys

from pdserve.engine.grammar_worker import frame, read_frame


def render(tokenizer, job: dict) -> dict:
    from pdserve.control.errors import InvalidRequestError
    from pdserve.engine.chat import render_chat

    try:
        return {"text": render_chat(tokenizer, job["conversation"], **job["options"])}
    except InvalidRequestError as exc:
        return {"problem": str(exc), "field": getattr(exc, "field", "messages")}
    except MemoryError:
        return {"problem": "the chat template used more memory than the server allows one render: send a simpler "
                           "template", "field": "chat_template"}


def main(argv: list[str]) -> None:
    model, memory_bytes, cpu_s = argv[0], int(argv[1]), int(argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    jobs, answers = sys.stdin.buffer, sys.stdout.buffer
    answers.write(frame({"ready": True}))
    answers.flush()
    while (job := read_frame(jobs)) is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(used.ru_utime + used.ru_stime) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_s, resource.RLIM_INFINITY))  # SIGXCPU past it
        answers.write(frame(render(tokenizer, job)))
        answers.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
