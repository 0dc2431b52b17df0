"""`pdserve profile`: one engine measured in-process, step by step, and the KV link between two processes;
the fits of planner/profile/fit.py over the points, written as the profile JSON `pdserve plan` reads.

On CPU the engine runs pinned to one core with one thread, as each engine of `pdserve sweep` does.
Prefill points: prompts of several lengths, alone and batched (chunked at the token budget). Decode
points: batches of several sizes over several prompt lengths, a few decode steps each. Transfer points:
KV messages of several sizes over loopback tcp with CURVE, sender and receiver on a core each
(planner/profile/kv_link.py's processes). With two cores or more on CPU, the co-run factor of decode steps
(planner/profile/corun.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np

from pdserve.planner.profile.fit import (
    DecodePoint,
    DeviceCapability,
    EngineSettings,
    PrefillPoint,
    Profile,
    TransferPoint,
    build_profile,
    load_profile,
    model_identity,
)
from pdserve.planner.profile.report import print_profile

# (prompt length, prompts in one batch): single prompts trace the quadratic, batches the chunking.
PREFILL_SHAPES = [(16, 1), (64, 1), (256, 1), (512, 1), (1024, 1), (1536, 1), (2000, 1), (256, 4), (1000, 2),
                  (1000, 3)]
# (batch, prompt length): decode steps timed after the batch's prompts are computed. Mid batches over mid contexts
# (12 and 24 x 256) are where served decode engines run; without them the plane over-predicted a step of 24 x 256 by
# 6-10% (docs/design/planner-model.md).
DECODE_SHAPES = [(1, 16), (4, 16), (16, 16), (32, 16), (64, 16), (1, 512), (4, 512), (8, 512), (1, 1500), (4, 1000),
                 (12, 256), (24, 256)]
DECODE_STEPS = 4
TRANSFER_MIB = [1, 4, 16, 44]
TRANSFER_REQUESTS = 3
QUICK_PREFILL = [(16, 1), (64, 1), (128, 1), (64, 2)]
QUICK_DECODE = [(1, 16), (2, 16), (4, 16), (2, 64)]
QUICK_TRANSFER_MIB = [1, 2]
QUICK_REFERENCE_LEN = 64


@contextlib.contextmanager
def one_core(core: int | None):
    """This process on one core with one torch thread while measuring (as a sweep engine runs), then back."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[0] if core is None else core
    if chosen not in allowed:
        raise ValueError(f"--core {core} is not one this process may use ({allowed})")
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {chosen})
    torch.set_num_threads(1)
    try:
        yield chosen
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)


def timed_step(engine) -> tuple[float, float, list]:
    """One engine step as EngineCore.step runs it: (wall s, this thread's CPU s, [(new tokens, computed
    before)] per request)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    plan = engine.scheduler.schedule()
    shapes = [(s.num_new_tokens, s.request.num_computed_tokens) for s in plan.scheduled]
    sampled = engine.runner.execute(plan, engine.kv_transfer.layer_hook(plan)).sampled
    engine.scheduler.update_from_output(plan, sampled)
    return time.perf_counter() - start, time.thread_time() - start_cpu, shapes


class EngineProbe:
    """The engine and fresh random prompts (no prefix-cache hits between measurements)."""

    def __init__(self, model: str, device: str, max_num_batched_tokens: int, dtype: str = "auto") -> None:
        from pdserve import LLM

        self.llm = LLM(model, dtype=dtype, device=device, max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=False)
        self.engine = self.llm.engine
        self.vocab = self.llm.model_config.vocab_size
        self.rng = np.random.default_rng(0)
        self.count = 0

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from pdserve import SamplingParams

        ids = self.rng.integers(10, self.vocab, size=prompt_len).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.count += 1
        self.engine.add_request(self.engine.make_request(f"p{self.count}", ids, params))

    def drain(self) -> None:
        while self.engine.has_work():
            self.engine.step()

    def prefill_points(self, prompt_len: int, batch: int) -> list[PrefillPoint]:
        for _ in range(batch):
            self.add(prompt_len, 1)
        points = []
        while self.engine.has_work():
            seconds, cpu_seconds, shapes = timed_step(self.engine)
            if shapes:
                points.append(PrefillPoint(prompt_len=prompt_len, batch=batch, tokens=sum(n for n, _ in shapes),
                                           attention=float(sum(n * (n + 2 * c) for n, c in shapes)), seconds=seconds,
                                           cpu_seconds=cpu_seconds))
        return points

    def decode_points(self, batch: int, prompt_len: int) -> list[DecodePoint]:
        for _ in range(batch):
            self.add(prompt_len, DECODE_STEPS + 2)
        points = []
        while self.engine.has_work():
            seconds, cpu_seconds, shapes = timed_step(self.engine)
            if shapes and all(n == 1 for n, _ in shapes) and len(shapes) == batch:
                points.append(DecodePoint(batch=batch, context=sum(c + 1 for _, c in shapes),
                                          longest=max(c + 1 for _, c in shapes), seconds=seconds,
                                          cpu_seconds=cpu_seconds))
        return points


class Phases:
    """The profile's steps as they run: a progress bar on a terminal, else one line per step with the time left
    (pdserve/progress.py). The default prints nothing (a caller that only measures)."""

    def __init__(self, total: int = 0) -> None:
        from pdserve.progress import Progress

        self.progress = Progress(total, "pdserve profile") if total else None

    @contextlib.contextmanager
    def step(self, label: str):
        if self.progress is not None:
            self.progress.start(label)
        yield
        if self.progress is not None:
            self.progress.finish()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def engine_shapes(args) -> tuple[list, list]:
    """(prefill shapes, decode shapes) timed in this process; no decode shapes where a served engine times them."""
    prefill_shapes, decode_shapes = (QUICK_PREFILL, QUICK_DECODE) if args.quick else (PREFILL_SHAPES, DECODE_SHAPES)
    return prefill_shapes, [] if served_decode(args) else decode_shapes


def phase_count(args) -> int:
    """The steps run_profile runs: the engine's load, its kernels' compile (GPU), each timed pass, on CPU the
    served engine's decode shapes, reference prompt and co-run step, and the KV link."""
    on_cpu = args.device == "cpu"
    return 1 + (not on_cpu) + args.repeats + (on_cpu * (2 + served_decode(args))) + 1


def shapes_label(prefill_shapes: list, decode_shapes: list) -> str:
    return f"{len(prefill_shapes)} prefill shapes" + (f", {len(decode_shapes)} decode shapes" if decode_shapes else "")


def measure_engine(args, model: str, phases: Phases | None = None
                   ) -> tuple[list[PrefillPoint], list[DecodePoint], EngineSettings]:
    phases = phases or Phases()
    prefill_shapes, decode_shapes = engine_shapes(args)
    with phases.step("loading the model and warming the engine up"):
        probe = EngineProbe(model, args.device, args.max_num_batched_tokens, args.dtype)
        probe.prefill_points(64, 1)  # warm-up: first-step allocations
        probe.decode_points(2, 16)
    max_len = probe.llm.model_config.max_model_len
    if args.device != "cpu":
        # Triton compiles a kernel for each new specialization of its arguments on first use (about 3 s each
        # on an H200, three of the eleven prefill points of the first GPU profile): every shape once, untimed.
        with phases.step(f"compiling the GPU kernels: {shapes_label(prefill_shapes, decode_shapes)}, untimed"):
            measure_shapes(probe, prefill_shapes, decode_shapes, max_len)
    prefill, decode = [], []
    for n in range(args.repeats):
        passes = f" (pass {n + 1} of {args.repeats})" if args.repeats > 1 else ""
        with phases.step(f"timing {shapes_label(prefill_shapes, decode_shapes)} in this process{passes}"):
            shape_prefill, shape_decode = measure_shapes(probe, prefill_shapes, decode_shapes, max_len)
        prefill += shape_prefill
        decode += shape_decode
    runner = probe.engine.runner
    settings = EngineSettings(block_size=probe.engine.cache_config.block_size,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=probe.engine.scheduler.config.max_num_seqs, num_kv_blocks=runner.num_blocks,
                              decode_pads_to_longest=runner.attn_backend.decode_pads_to_longest,
                              decode_groups_by_length=runner.attn_backend.decode_groups_by_length,
                              dtype=str(probe.llm.model_config.dtype).removeprefix("torch."))
    return prefill, decode, settings, max_len


def measure_shapes(probe: EngineProbe, prefill_shapes, decode_shapes, max_len: int):
    """One pass over the shapes that fit the model: (prefill points, decode points)."""
    prefill, decode = [], []
    for prompt_len, batch in prefill_shapes:
        if prompt_len + 1 <= max_len:
            prefill += probe.prefill_points(prompt_len, batch)
    for batch, prompt_len in decode_shapes:
        if prompt_len + DECODE_STEPS + 2 <= max_len:
            decode += probe.decode_points(batch, prompt_len)
    return prefill, decode


def served_decode(args: argparse.Namespace) -> bool:
    """Decode points from a served engine process: on CPU unless --in-process-decode (a served engine's step
    includes its serving loop, ZeroMQ and CURVE, about 4% on the demo model, docs/design/planner-model.md); never on a GPU."""
    if args.device != "cpu":
        if args.served_decode:
            raise ValueError(f"--served-decode times a served engine pinned to a CPU core; on --device {args.device} "
                             "decode steps are timed in-process: drop the flag")
        return False
    return not args.in_process_decode


def measure_served(args, model: str, core: int, machine: dict, max_len: int, phases: Phases) -> list[DecodePoint]:
    """Through a served engine on the same core: the reference prefill (into machine["reference"]) and, unless
    --in-process-decode, the decode points (else [])."""
    from pdserve.planner.profile.served import (
        REFERENCE_PROMPT_LEN,
        served_decode_passes,
        served_engine,
        served_prefill_reference,
    )

    served, shapes = served_decode(args), QUICK_DECODE if args.quick else DECODE_SHAPES
    prompt_len = min(QUICK_REFERENCE_LEN if args.quick else REFERENCE_PROMPT_LEN, max_len - 1)
    reference = f"a reference prompt of {prompt_len} tokens"
    decode = []
    with contextlib.ExitStack() as stack:
        first = f"timing {len(shapes)} decode shapes" if served else f"timing {reference}"
        with phases.step(f"starting a served engine process, {first} through it"):
            session = stack.enter_context(served_engine(model, core, args.max_num_batched_tokens, args.dtype))
            if served:
                with timed_phase(machine, "served_decode"):
                    decode = served_decode_passes(session, shapes, args.repeats)
                machine["decode_points"] = "served: a pdserve decode process with CURVE, its CPU time per step"
            else:
                with timed_phase(machine, "reference"):
                    machine["reference"] = served_prefill_reference(session, prompt_len)
        if served:
            with phases.step(f"timing {reference} through the served engine"), timed_phase(machine, "reference"):
                machine["reference"] = served_prefill_reference(session, prompt_len)
        with phases.step("co-run: decode steps while another core computes" + (" (skipped)" if args.no_corun else "")):
            with timed_phase(machine, "corun"):
                machine["decode_corun"] = measure_corun(args, model, core, session, prompt_len,
                                                        args.max_num_batched_tokens, max_len)
    return decode


def measure_corun(args, model: str, core: int, session: tuple, prompt_len: int, max_num_batched_tokens: int,
                  max_len: int) -> dict:
    """The served engine's decode steps alone, beside prompts computed on another core, and beside decode steps
    run there (corun.py); on one core, or with --no-corun, factor 1.0 and why."""
    from pdserve.planner.profile.corun import (
        CORUN_REPEATS,
        CORUN_SHAPES,
        DECODE,
        PREFILL,
        QUICK_CORUN_SHAPES,
        fitting_shapes,
        measure_decode_corun,
        other_core,
    )

    if args.no_corun:
        return {"factor": 1.0, "skipped": "--no-corun"}
    second = other_core(core, os.sched_getaffinity(0))
    if second is None:
        print("  co-run factor skipped: one core, no other engine can share this host (factor 1.0)")
        return {"factor": 1.0, "skipped": "one core: no second core to compute prompts on"}
    shapes, repeats = (QUICK_CORUN_SHAPES, 1) if args.quick else (CORUN_SHAPES, CORUN_REPEATS)
    shapes = fitting_shapes(shapes, max_len)
    measured = measure_decode_corun(session, model, second, max_num_batched_tokens, prompt_len, shapes, repeats,
                                    dtype=args.dtype)
    return {**measured[PREFILL], "beside_decode": measured[DECODE]}


def measure_transfer(sizes_mib: list[int], num_requests: int) -> list[TransferPoint]:
    """Seconds per request of pdserve's KV messages (tcp loopback, CURVE) and the CPU each side spent."""
    from pdserve.planner.profile.kv_link import MIB, messages_per_request, run_scenarios

    scenarios = [("tcp", "kv", size, messages_per_request(size, 4), num_requests, "tcp://127.0.0.1:0")
                 for size in sizes_mib]
    results = run_scenarios(scenarios, pin=True, curve=True)
    wall = {index: seconds for role, index, seconds, _, _ in results if role == "send"}
    cpu = {(role, index): cpu_s for role, index, _, cpu_s, _ in results}
    thread_cpu = {(role, index): cpu_s for role, index, _, _, cpu_s in results}
    return [TransferPoint(bytes=size * MIB, seconds=wall[i] / num_requests,
                          sender_cpu_s=cpu[("send", i)] / num_requests, receiver_cpu_s=cpu[("recv", i)] / num_requests,
                          sender_thread_cpu_s=thread_cpu[("send", i)] / num_requests,
                          receiver_thread_cpu_s=thread_cpu[("recv", i)] / num_requests)
            for i, size in enumerate(sizes_mib)]


@contextlib.contextmanager
def timed_phase(machine: dict, name: str):
    """The seconds a step of the profile took, kept in machine["phase_seconds"] (printed with the fits)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        machine.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - started, 1)


def machine_info(device: str, core: int | None) -> dict:
    import torch

    from pdserve.engine.config import cpu_model_name

    info = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "pinned_core": core, "torch": torch.__version__,
            "python": platform.python_version(), "device": device, "load_average": list(os.getloadavg()),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.demo_model import default_demo_model
    from pdserve.engine.config import check_device, device_capability

    if args.refit:
        return refit(args)
    served_decode(args)  # refuses --served-decode on a GPU before anything is measured
    if args.device != "cpu":
        check_device(args.device)  # a clear error, not torch's, where there is no GPU
    model = args.model or str(default_demo_model())
    if args.add_corun_to:
        return add_corun(args, model)
    args.dtype = resolve_dtype(model, args.dtype, args.device)  # once: every engine of the profile computes in it
    identity = model_identity(model, args.dtype)
    started = time.perf_counter()
    phases = Phases(phase_count(args))
    try:
        machine, prefill, decode, settings, transfer = measure_all(args, model, phases)
    finally:
        phases.close()
    clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    profile = note_reference(build_profile(identity, machine, settings, prefill, decode, transfer, clock,
                                           DeviceCapability(**device_capability(args.device))))
    Path(args.out).write_text(profile.model_dump_json(indent=1))
    print_profile(profile, f"profiled {profile.model.architecture} ({profile.model.num_layers} layers, hidden "
                  f"{profile.model.hidden_size}) on {device_name(profile.machine)} in "
                  f"{time.perf_counter() - started:.0f} s -> {args.out}", args.verbose)
    return 0


def resolve_dtype(model: str, dtype: str, device: str) -> str:
    """The dtype `--dtype` (auto, or a name) resolves to for this model on this device, as `pdserve up`'s engines
    resolve it; printed with the reason."""
    from pdserve.engine.config import ModelConfig

    config = ModelConfig.from_hf(model, dtype=dtype, device=device)
    resolved = str(config.dtype).removeprefix("torch.")
    print(f"[pdserve profile] computing in {resolved} ({config.dtype_reason})", flush=True)
    return resolved


def measure_all(args, model: str, phases: Phases) -> tuple:
    """Every step of a new profile: (machine, prefill points, decode points, engine settings, transfer points)."""
    pinned = one_core(args.core) if args.device == "cpu" else contextlib.nullcontext(None)
    with pinned as core:
        machine = machine_info(args.device, core)
        with timed_phase(machine, "engine"):
            prefill, decode, settings, max_len = measure_engine(args, model, phases)
    if args.device == "cpu":
        with timed_phase(machine, "served"):
            decode = measure_served(args, model, core, machine, max_len, phases) or decode
    else:  # a host CPU effect: engines on GPUs of their own do not slow each other's steps through it
        machine["decode_corun"] = {"factor": 1.0, "skipped": f"device {args.device}"}
    sizes = QUICK_TRANSFER_MIB if args.quick else TRANSFER_MIB
    with phases.step(f"KV link: messages of {', '.join(map(str, sizes))} MiB between two processes"):
        with timed_phase(machine, "transfer"):
            transfer = measure_transfer(sizes, TRANSFER_REQUESTS)
    return machine, prefill, decode, settings, transfer


def device_name(machine: dict) -> str:
    """'cpu (Intel Xeon ...)' or 'cuda (NVIDIA H100 ...)': the device and what it is."""
    what = machine.get("gpu") or machine.get("cpu")
    return f"{machine['device']} ({what})" if what else machine["device"]


def note_reference(profile: Profile) -> Profile:
    """What the prefill fit says for the served engine's reference prompt, beside that engine's time."""
    reference = profile.machine.get("reference")
    if reference is not None:
        length = reference["prompt_len"]
        reference["profile_prefill_s"] = profile.prefill_fit.predict(
            {"intercept": 1.0, "tokens": length, "attention": float(length * length)})
    return profile


def refuse_overwrite(out: str, source: str, flag: str, what: str) -> None:
    """--out must not be the profile that `flag` reads: the profile read is kept as it was measured."""
    if Path(out).resolve() == Path(source).resolve():
        raise ValueError(f"--out {out} is the profile {flag} reads: write {what} elsewhere")


def refit(args: argparse.Namespace) -> int:
    """--refit P.json: P's points fitted again (on P's clock unless --clock says otherwise), written to --out."""
    refuse_overwrite(args.out, args.refit, "--refit", "the new one")
    old = load_profile(args.refit)
    profile = note_reference(build_profile(old.model, old.machine, old.engine, old.prefill_points, old.decode_points,
                                           old.transfer_points, args.clock or old.clock, old.capability))
    Path(args.out).write_text(profile.model_dump_json(indent=1))
    print_profile(profile, f"refitted the points of {args.refit} -> {args.out}", args.verbose)
    return 0


def add_corun(args: argparse.Namespace, model: str) -> int:
    """--add-corun-to P.json: only the co-run step, written into a copy of P (at --out)."""
    from pdserve.planner.profile.served import REFERENCE_PROMPT_LEN, served_engine
    from pdserve.engine.config import ModelConfig

    if args.device != "cpu":
        raise ValueError(f"--add-corun-to measures CPU engines sharing a host, not --device {args.device}: "
                         "a GPU profile keeps factor 1.0")
    refuse_overwrite(args.out, args.add_corun_to, "--add-corun-to", "the copy")
    profile = load_profile(args.add_corun_to)
    args.dtype = profile.engine.dtype or "float32"  # the co-run engines compute as the profiled one did
    profile.check_model(model_identity(model, profile.model.dtype), model)
    started = time.perf_counter()
    core = args.core if args.core is not None else min(os.sched_getaffinity(0))
    prompt_len = (profile.machine.get("reference") or {}).get("prompt_len", REFERENCE_PROMPT_LEN)
    budget = profile.engine.max_num_batched_tokens  # the profiled engine's, not the flag's default
    max_len = ModelConfig.from_hf(model).max_model_len
    with served_engine(model, core, budget, args.dtype) as session:
        corun = measure_corun(args, model, core, session, prompt_len, budget, max_len)
    machine = {**profile.machine, "decode_corun": {**corun, "pinned_core": core}}
    profile = profile.model_copy(update={"machine": machine})
    Path(args.out).write_text(profile.model_dump_json(indent=1))
    print_profile(profile, f"co-run step in {time.perf_counter() - started:.0f} s: {args.add_corun_to} -> {args.out}",
                  args.verbose)
    return 0
