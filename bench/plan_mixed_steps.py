"""How much a step that computes a prompt costs when decodes ride along (the planner's mixed-step model):

    python -m pdserve.bench.plan_mixed_steps [--model DIR] [--repeats 3]

In one engine pinned to one core with one thread (as `pdserve profile` runs it), CPU time of: a decode-only step of
k requests (200-token prompts), a prompt of n tokens alone, and the step that computes that prompt while the k
decode. Printed per (k, n) with mixed / (decode + prompt), the sum an engine would pay if the two did not share the
step's weight reads, and mixed - prompt, what the decodes add to it."""

from __future__ import annotations

import argparse
import statistics

from pdserve.bench.plan_profile import EngineProbe, one_core, timed_step

SHAPES = [(4, 128), (8, 128), (8, 512), (16, 128)]  # (decodes k, prompt tokens n)
CONTEXT = 200  # the decoding requests' prompts


def measure(probe: EngineProbe, decodes: int, prompt_len: int, context: int = CONTEXT) -> tuple[float, float, float]:
    """CPU seconds of (a decode-only step, the prompt alone, the mixed step) for one repeat."""
    for _ in range(decodes):
        probe.add(context, 60)
    while True:  # until all of them decode
        _, _, shapes = timed_step(probe.engine)
        if shapes and len(shapes) == decodes and all(n == 1 for n, _ in shapes):
            break
    decode = statistics.median(timed_step(probe.engine)[1] for _ in range(3))
    probe.add(prompt_len, 1)
    mixed = timed_step(probe.engine)[1]
    probe.drain()
    probe.add(prompt_len, 1)
    alone = timed_step(probe.engine)[1]
    probe.drain()
    return decode, alone, mixed


def shape(text: str) -> tuple[int, int]:
    """--shapes K,N: k decodes beside a prompt of n tokens (both 1 or more)."""
    try:
        decodes, prompt_len = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K,N (decodes, prompt tokens), e.g. 8,128") from None
    if decodes < 1 or prompt_len < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: K and N must be 1 or more")
    return decodes, prompt_len


def main(argv: list[str] | None = None) -> int:
    from pdserve.demo_model import default_demo_model

    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.plan_mixed_steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the built-in demo model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--core", type=int, default=None, help="the core to pin to (default: the first allowed)")
    parser.add_argument("--shapes", nargs="+", type=shape, metavar="K,N", help="(decodes, prompt tokens) pairs (default: "
                        + " ".join(f"{k},{n}" for k, n in SHAPES) + ")")
    args = parser.parse_args(argv)
    shapes = args.shapes or SHAPES
    with one_core(args.core):
        probe = EngineProbe(args.model or str(default_demo_model()), "cpu", 2048)
        probe.prefill_points(16, 1)  # warm-up
        for decodes, prompt_len in shapes:
            runs = [measure(probe, decodes, prompt_len) for _ in range(args.repeats)]
            decode, alone, mixed = (1000 * statistics.median(run[i] for run in runs) for i in range(3))
            print(f"k={decodes:2d} n={prompt_len:4d}: decode step {decode:6.1f} ms, prompt alone {alone:6.1f}, mixed "
                  f"{mixed:6.1f}; mixed / (decode + prompt) {mixed / (decode + alone):.2f}; mixed - prompt "
                  f"{mixed - alone:+6.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
