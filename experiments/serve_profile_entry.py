"""Entry points serve_profile.py starts; each patches, then runs pdserve's normal code (as the tests' fault
launchers do):

    python experiments/serve_profile_entry.py up ARGS...       `pdserve up ARGS`, with the engine named by
                                                               $SERVE_PROFILE_ENGINE (e.g. decode-0) started
                                                               through `engine` below
    python experiments/serve_profile_entry.py engine ROLE ARGS `pdserve ROLE ARGS` with its loop timed
                                                               (step_spans) while $SERVE_PROFILE_DIR/start
                                                               exists and /stop does not; the rounds go to
                                                               $SERVE_PROFILE_DIR/engine.json
    python experiments/serve_profile_entry.py offline --model DIR --dtype D --batch 8 --input-len 256
                                                      --output-len 64 --out FILE
                                                               the offline engine's steps, timed the same way
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import step_spans

MARKER_POLL_S = 0.05
HERE = Path(__file__).resolve()


def profiled_engine_components(original, engine_name: str):
    """pdserve.up.engine_components with `engine_name`'s command run through this file's `engine` mode."""
    def components(*args, **kwargs):
        result = original(*args, **kwargs)
        for component in result:
            if component.name == engine_name:
                if component.command[1:3] != ["-m", "pdserve"]:
                    raise RuntimeError(f"unexpected engine command {component.command[:4]}: update {HERE.name}")
                component.command[1:3] = [str(HERE), "engine"]
        return result
    return components


def run_up(argv: list[str]) -> int:
    from pdserve import up
    from pdserve.cli import main

    up.engine_components = profiled_engine_components(up.engine_components, os.environ["SERVE_PROFILE_ENGINE"])
    return main(["up", *argv])


def watch_markers(clock: step_spans.StepClock, folder: Path) -> None:
    """Record between the start and stop markers, then write what was recorded."""
    while not (folder / "start").exists():
        time.sleep(MARKER_POLL_S)
    threads_before, started = step_spans.thread_times(), time.perf_counter()
    clock.recording = True
    while not (folder / "stop").exists():
        time.sleep(MARKER_POLL_S)
    clock.recording = False
    window_s = time.perf_counter() - started
    while clock.round_open:  # the main thread closes the open round at its next boundary
        time.sleep(MARKER_POLL_S)
    write_json(folder / "engine.json", {
        "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)), "window_s": window_s, "threads_before": threads_before,
        "threads_after": step_spans.thread_times(), "rounds": [r.as_dict() for r in clock.rounds]})


def write_json(path: Path, data: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    partial.rename(path)


def run_engine(argv: list[str]) -> int:
    from pdserve.cli import main
    from pdserve.control.engine_server import EngineServer

    folder = Path(os.environ["SERVE_PROFILE_DIR"])
    run = EngineServer.run

    def run_timed(self) -> None:
        clock = step_spans.StepClock()  # on the loop's thread
        step_spans.install_served(clock, self)
        threading.Thread(target=watch_markers, args=(clock, folder), name="serve-profile", daemon=True).start()
        run(self)
    EngineServer.run = run_timed
    return main(argv)


def run_offline(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="serve_profile_entry.py offline")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    vocab = llm.model_config.vocab_size
    prompts = [{"prompt_token_ids": [(17 + 31 * i + 7 * j) % (vocab - 10) + 5 for j in range(args.input_len)]}
               for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain_s = time.perf_counter() - start
    clock = step_spans.StepClock()
    step_spans.install_offline(clock, llm.engine)
    clock.recording = True
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    timed_s = time.perf_counter() - start
    clock.recording = False
    clock.boundary()  # closes the last step's round
    write_json(Path(args.out), {"pid": os.getpid(), "generate_s": plain_s, "generate_timed_s": timed_s,
                                "rounds": [r.as_dict() for r in clock.rounds]})
    return 0


if __name__ == "__main__":
    modes = {"up": run_up, "engine": run_engine, "offline": run_offline}
    if len(sys.argv) < 2 or sys.argv[1] not in modes:
        sys.exit(f"usage: {HERE.name} {{{'|'.join(modes)}}} ARGS...")
    sys.exit(modes[sys.argv[1]](sys.argv[2:]))
