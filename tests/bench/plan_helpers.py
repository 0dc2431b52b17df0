"""Synthetic engine profiles for the plan tests: points exactly on known coefficients."""

from __future__ import annotations

from pdserve.bench.plan_fit import (
    DecodePoint,
    EngineSettings,
    ModelIdentity,
    PrefillPoint,
    Profile,
    TransferPoint,
    build_profile,
)

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
    return build_profile(identity, machine, EngineSettings(num_kv_blocks=4096), prefill, decode, transfer)
