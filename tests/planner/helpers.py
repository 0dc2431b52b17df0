"""Synthetic engine profiles for the plan tests: points exactly on known coefficients."""

from __future__ import annotations

import json

from pdserve.planner.profile.fit import (
    DecodePoint,
    DeviceCapability,
    EngineSettings,
    ModelIdentity,
    PrefillPoint,
    Profile,
    TransferPoint,
    build_profile,
)
from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects
from pdserve.planner.model.simulator import ClusterSpec, StepModel, simulate
from pdserve.planner.model.workload import random_workload

PREFILL = {"intercept": 0.01, "tokens": 2e-4, "attention": 3e-8}
DECODE = {"intercept": 0.02, "batch": 1e-3, "context": 2e-6}
TRANSFER = {"intercept": 0.002, "bytes": 5e-9}


def synthetic_profile(identity: ModelIdentity, noise: float = 0.0) -> Profile:
    """A profile whose points lie on PREFILL/DECODE/TRANSFER (times 1 +- noise, alternating)."""
    def jitter(i: int) -> float:
        return 1 + noise * (1 if i % 2 else -1)

    prefill = []
    for i, (length, batch) in enumerate([(16, 1), (64, 1), (256, 1), (512, 1), (1024, 1), (128, 4), (300, 2)]):
        tokens, attention = length * batch, float(batch * length * length)
        seconds = (PREFILL["intercept"] + PREFILL["tokens"] * tokens + PREFILL["attention"] * attention) * jitter(i)
        prefill.append(PrefillPoint(prompt_len=length, batch=batch, tokens=tokens, attention=attention,
                                    seconds=seconds, cpu_seconds=seconds))
    decode = []
    for i, (batch, context) in enumerate([(1, 20), (4, 100), (16, 400), (32, 3000), (8, 8000), (2, 50)]):
        seconds = (DECODE["intercept"] + DECODE["batch"] * batch + DECODE["context"] * context) * jitter(i)
        decode.append(DecodePoint(batch=batch, context=context, seconds=seconds, cpu_seconds=seconds))
    transfer = []
    for i, num_bytes in enumerate([1 << 20, 4 << 20, 16 << 20]):
        seconds = (TRANSFER["intercept"] + TRANSFER["bytes"] * num_bytes) * jitter(i)
        transfer.append(TransferPoint(bytes=num_bytes, seconds=seconds, sender_cpu_s=seconds / 2,
                                      receiver_cpu_s=seconds / 3))
    machine = {"cpu": "synthetic", "cores": 1, "device": "cpu"}
    capability = DeviceCapability(device="cpu", name="synthetic", native_bf16=False, amx=False)
    return build_profile(identity, machine, EngineSettings(num_kv_blocks=4096, dtype=identity.dtype), prefill, decode,
                         transfer, capability=capability)


def write_sweep(sweep_dir, model_dir, profile, shift: float = 0.0, later_shift: float = 0.0,
                speed: tuple[float, float] = (1.0, 1.0), references: int = 0,
                host: tuple[float, float] | None = None, dtype: str | None = None) -> None:
    """A sweep directory in `pdserve sweep`'s run format whose 'measured' arrays are the simulator's own
    prediction (times 1 + shift; the ITLs after the first also times 1 + later_shift), so a replay must find
    them again. `speed`: the 'machine' ran the profile's prefill and decode steps that much slower; `references`:
    with that many requests, a reference run (one request at a time, at that speed) before each load and after
    the last, as `pdserve sweep --reference-requests` writes them. `host` (CPU seconds per streamed token, cores in
    the background): the 'machine' charged them to its busy engines, and each run records that CPU over its tokens
    and duration (two thirds the router's server_cpu_s, a third the client's client_cpu_s); None: runs without
    those figures (a sweep before them). `dtype`: the engines' compute dtype the runs record (None: a sweep before
    pdserve recorded it)."""
    runs = sweep_dir / "runs"
    runs.mkdir(parents=True)
    workload = random_workload(30, 200, 20, range_ratio=0.3, seed=0)
    machine, effects = profile_machine(profile, speed, host)
    for config, (x, y) in (("1P1D", (1, 1)), ("0P2D", (0, 2))):
        spec = ClusterSpec(x, y, profile.engine, profile.model.kv_bytes_per_token)
        layout = {"config": config, "num_prefill": x, "num_decode": y, "num_engines": x + y,
                  **({"dtype": dtype} if dtype else {})}
        for index, rate in enumerate((2.0, 6.0)):
            done = simulate(spec, machine, workload.arrivals(rate, seed=0), workload.prompt_lens, workload.output_lens,
                            effects=effects)
            run = {"model_id": str(model_dir), "config": config, "request_rate": rate, "burstiness": 1.0, "seed": 0,
                   "max_concurrency": None, "goodput": {"ttft": 300.0, "tpot": 40.0}, "sweep": dict(layout),
                   "input_lens": workload.prompt_lens, "output_lens": workload.output_lens,
                   "ttfts": [r.ttft * (1 + shift) for r in done], "errors": [""] * len(done),
                   "itls": [[itl * (1 + shift) * (1 + later_shift * (k > 0)) for k, itl in enumerate(simulated_itls(r))]
                            for r in done]}
            run["e2els"] = [ttft + sum(itls) for ttft, itls in zip(run["ttfts"], run["itls"])]
            if host is not None:
                record_host_cpu(run, host, max(r.finish for r in done))
            if references:
                run["sweep"]["order"] = 2 * index + 1
            (runs / f"{config}_rate{rate}.json").write_text(json.dumps(run))
        for number in range(3 if references else 0):
            reference = reference_run(spec, machine, references, 200, 20, effects)
            reference.update(model_id=str(model_dir), config=config,
                             sweep={**layout, "phase": "reference", "order": 2 * number})
            if host is not None:
                record_host_cpu(reference, host, sum(t + sum(i) for t, i in zip(reference["ttfts"], reference["itls"])))
            (runs / f"{config}_reference{number}.json").write_text(json.dumps(reference))


def record_host_cpu(run: dict, host: tuple[float, float], duration: float) -> None:
    """The run's host CPU as a sweep records it: per token and per second of `host`, two thirds the router's."""
    tokens = sum(run["output_lens"])
    cpu = host[0] * tokens + host[1] * duration
    run.update(total_output_tokens=tokens, duration=duration, client_cpu_s=cpu / 3,
               server_metrics={"server_cpu_s": cpu * 2 / 3})


def profile_machine(profile: Profile, speed: tuple[float, float] = (1.0, 1.0),
                    host: tuple[float, float] | None = None) -> tuple[StepModel, HostEffects]:
    """The profile's step model and its CPU host's effects, the steps `speed` (prefill, decode) times as long and
    the host's CPU `host` (seconds per streamed token, cores in the background)."""
    effects = HostEffects(tuple(speed), profile.decode_corun, profile.decode_beside_decode, *(host or (0.0, 0.0)),
                          profile.engine.decode_pads_to_longest, profile.decode_groups_by_length)
    return effects.scaled(StepModel.from_profile(profile)), effects


def reference_run(spec: ClusterSpec, machine: StepModel, count: int, prompt_len: int, output_len: int,
                  effects: HostEffects = NO_HOST_EFFECTS) -> dict:
    """`count` requests of these lengths one at a time on `machine`, in bench's run format."""
    alone = [simulate(spec, machine, [0.0], [prompt_len], [output_len], effects=effects)[0] for _ in range(count)]
    return {"request_rate": "inf", "max_concurrency": 1, "burstiness": 1.0, "seed": 30_000,
            "input_lens": [prompt_len] * count, "output_lens": [output_len] * count,
            "ttfts": [r.ttft for r in alone], "itls": [simulated_itls(r) for r in alone], "errors": [""] * count}


def simulated_itls(request) -> list[float]:
    """A simulated request's ITLs as bench writes them: its first ITL, then the rest of its decode evenly."""
    rest = request.output_len - 2
    later = [(request.finish - request.second_token) / rest] * rest if rest > 0 else []
    return [request.first_itl, *later] if request.first_itl is not None else []
