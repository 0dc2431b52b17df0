"""The engine profile `pdserve profile` writes and `pdserve plan` reads: the model it measured, the
machine, the raw points, and three least-squares fits with their errors.

    prefill step  = p0 + p_token * tokens + p_attention * sum(n * (n + 2 * cached))   (quadratic in length)
    decode step   = d0 + d_seq * batch + d_context * context tokens attended            (linear)
    KV transfer   = latency + bytes * seconds_per_byte                                  (over the KV link)

A chunk of n new tokens after `cached` computed ones attends to n * (n + 2 * cached) / 2 earlier pairs, so
a single prompt of length L has the feature L^2: the papers' quadratic prefill. The context a decode step
attends is the sum of its sequences' contexts, or batch x the longest where the backend pads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.planner.profile.corun_fit import CoRun, corun_terms

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1


class ProfileError(ValueError):
    pass


class ModelIdentity(BaseModel):
    """What makes two engines' timings comparable: the architecture, its dimensions and the KV dtype."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    kv_bytes_per_token: int
    config_hash: str  # sha256 of config.json's architecture fields (not its path)

    def differences(self, other: ModelIdentity) -> list[str]:
        mine, theirs = self.model_dump(), other.model_dump()
        return [f"{name} {mine[name]} != {theirs[name]}" for name in mine if mine[name] != theirs[name]]


def model_identity(model_dir: str | Path, dtype: str = "float32") -> ModelIdentity:
    from pdserve.engine.config import ModelConfig

    config = ModelConfig.from_hf(str(model_dir), dtype=dtype)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    shape_keys = sorted(k for k in hf if not k.startswith("_") and k not in ("transformers_version", "torch_dtype"))
    digest = hashlib.sha256(json.dumps({k: hf[k] for k in shape_keys}, sort_keys=True).encode()).hexdigest()[:16]
    return ModelIdentity(
        architecture=config.architecture, num_layers=config.num_layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, vocab_size=config.vocab_size, dtype=str(config.dtype).removeprefix("torch."),
        kv_bytes_per_token=config.kv_bytes_per_token, config_hash=digest)


class Fit(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    coefficients: dict[str, float]
    r2: float
    mean_relative_error: float
    num_points: int

    def predict(self, features: dict[str, float]) -> float:
        return sum(value * features[name] for name, value in self.coefficients.items())


class PrefillPoint(BaseModel):
    prompt_len: int
    batch: int
    tokens: int  # new tokens in this step
    attention: float  # sum over chunks of n * (n + 2 * cached)
    seconds: float  # wall time of the step
    cpu_seconds: float  # CPU time of the engine's one thread in it (what the step costs on a core of its own)


class DecodePoint(BaseModel):
    batch: int
    context: int  # the sum of the batch's contexts
    longest: int | None = None  # the longest context in the batch (None: all alike, context / batch)

    def attended(self, pads_to_longest: bool) -> float:
        """The context tokens the step's attention reads: batch x longest where the backend pads, else the sum."""
        if pads_to_longest and self.longest is not None:
            return float(self.batch * self.longest)
        return float(self.context)
    seconds: float
    cpu_seconds: float


class TransferPoint(BaseModel):
    bytes: int
    seconds: float  # wall time per request, first frame sent to the receiver's ack
    sender_cpu_s: float  # CPU the sending process spent per request (its engine's core), zmq's I/O thread included
    receiver_cpu_s: float
    # Of that, the CPU of the thread that sent or received (an engine's loop thread): what holds up the engine's
    # next step where zmq's I/O thread has a core of its own (a GPU host). None: a profile from before it was taken.
    sender_thread_cpu_s: float | None = None
    receiver_thread_cpu_s: float | None = None


class EngineSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_kv_blocks: int = 23301  # 1 GiB of fp32 KV of the demo model: the CPU default
    # The attention backend's decode reads every sequence padded to the step's longest context, so a step's
    # context term is batch x longest; else the sum of the contexts. Profiles written before this field were
    # all taken on the CPU backend when it still padded (before it grouped sequences by length).
    decode_pads_to_longest: bool = True
    # It groups the sequences by length and pads each group to its longest (kernels.length_groups.group_by_length):
    # the sum of the contexts plus the groups' padding. None (profiles before this field): grouped where the
    # backend did not pad to the longest on a CPU, as the CPU backend has since it stopped padding.
    decode_groups_by_length: bool | None = None
    # The dtype the engine computed in and kept its KV in, resolved (never "auto"). None: a profile from before
    # pdserve recorded it, whose dtype is unknown.
    dtype: str | None = None


class DeviceCapability(BaseModel):
    """What the profiled engine computed on (engine.config.device_capability): the CPU's model and whether it has
    native bf16 and AMX, or the GPU's name."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    name: str
    native_bf16: bool | None = None
    amx: bool | None = None


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = PROFILE_VERSION
    model: ModelIdentity
    machine: dict
    engine: EngineSettings
    prefill_points: list[PrefillPoint]
    decode_points: list[DecodePoint]
    transfer_points: list[TransferPoint]
    prefill_fit: Fit
    decode_fit: Fit
    transfer_fit: Fit
    clock: str = "wall"  # the fits' time: "wall", or "cpu" (a shared machine: what a core of its own would take)
    transfer_sender_cpu_per_byte: float
    transfer_receiver_cpu_per_byte: float
    capability: DeviceCapability | None = None  # None: a profile from before pdserve recorded it

    @property
    def decode_corun(self) -> CoRun:
        """How much slower a decode step's weights part and KV reads run while another engine of the host computes
        prefills (machine["decode_corun"], measured by `pdserve profile` on CPU; planner/profile/corun_fit.py); no
        slow-down for a profile without it."""
        return corun_terms(self.machine.get("decode_corun"), self.decode_fit.coefficients.get("context", 0.0))

    @property
    def decode_beside_decode(self) -> CoRun:
        """The same while another engine of the host runs decode steps (machine["decode_corun"]["beside_decode"])."""
        beside = (self.machine.get("decode_corun") or {}).get("beside_decode")
        return corun_terms(beside, self.decode_fit.coefficients.get("context", 0.0))

    @property
    def on_cpu(self) -> bool:
        """Whether the profiled engine ran on CPU cores (the machine's device)."""
        return str(self.machine.get("device", "cpu")) == "cpu"

    @property
    def decode_groups_by_length(self) -> bool:
        """Whether the engine's decode reads each group of similar lengths padded to its longest
        (EngineSettings.decode_groups_by_length; for a profile without the field, a CPU one that did not pad)."""
        grouped = self.engine.decode_groups_by_length
        if grouped is None:
            return not self.engine.decode_pads_to_longest and self.on_cpu
        return grouped

    def link_cpu_per_byte(self, side: str) -> float:
        """CPU seconds per byte that one side ("sender", "receiver") of the KV link takes from its engine's steps.
        A CPU engine has one core, which zmq's I/O thread shares: all of the process's link CPU counts. On a GPU
        host the I/O thread runs on another core: only the engine thread's own part, where the profile took it."""
        if self.on_cpu or any(getattr(p, f"{side}_thread_cpu_s") is None for p in self.transfer_points):
            return getattr(self, f"transfer_{side}_cpu_per_byte")
        return cpu_per_byte(self.transfer_points, f"{side}_thread")

    def check_dtype(self, dtype: str | None, where: str) -> None:
        """A ProfileError where the profile's compute dtype and `where`'s are both known and differ (None: unknown)."""
        mine = self.engine.dtype
        if mine is None or dtype is None or mine == dtype:
            return
        raise ProfileError(f"the profile's engine computed in {mine} but {where} computed in {dtype}: steps timed in "
                           f"one dtype do not predict the other; profile in {dtype} (`pdserve profile --dtype "
                           f"{dtype}`), or sweep in {mine} (`pdserve sweep --up-args '--dtype {mine}'`)")

    def check_model(self, identity: ModelIdentity, where: str) -> None:
        differences = self.model.differences(identity)
        if differences:
            raise ProfileError(f"the profile was measured on another model than {where} ({'; '.join(differences)}): "
                               f"run `pdserve profile --model <that model>` and plan with that profile")


def load_profile(path: str | Path) -> Profile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read the profile {path}: {exc.strerror}; make one with `pdserve profile`") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not a pdserve profile (not UTF-8 text); make one with `pdserve profile`") from None
    try:
        profile = Profile.model_validate_json(text)
    except ValidationError as exc:
        raise ProfileError(f"{path} is not a pdserve profile ({exc.error_count()} problems, first: "
                           f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}); make one with `pdserve profile`") from None
    if profile.version != PROFILE_VERSION:
        raise ProfileError(f"{path} is a version {profile.version} profile; this pdserve reads version "
                           f"{PROFILE_VERSION}: profile the engine again")
    problem = value_problem(profile)
    if problem:
        raise ProfileError(f"{path}: {problem}: a measured profile never has one (was it edited?); profile the "
                           "engine again with `pdserve profile`")
    if profile.engine.dtype is None or profile.capability is None:
        missing = " and ".join(what for what, value in (("compute dtype", profile.engine.dtype),
                                                        ("device capability", profile.capability)) if value is None)
        logger.warning("%s records no %s (a profile from before pdserve recorded it): taken as unknown, so "
                       "`plan --validate` cannot check it against a sweep's; profile again to record it", path, missing)
    return profile


def value_problem(profile: Profile) -> str:
    """What no measured profile holds ('' when none): a fit coefficient or link CPU cost that is negative or not
    finite (the fits keep every term >= 0), or a size below 1."""
    for name in ("prefill_fit", "decode_fit", "transfer_fit"):
        for term, value in getattr(profile, name).coefficients.items():
            if not (math.isfinite(value) and value >= 0):
                return f"{name} {term} is {value}, not a finite number >= 0"
    for name in ("transfer_sender_cpu_per_byte", "transfer_receiver_cpu_per_byte"):
        value = getattr(profile, name)
        if not (math.isfinite(value) and value >= 0):
            return f"{name} is {value}, not a finite number >= 0"
    sizes = {"model.kv_bytes_per_token": profile.model.kv_bytes_per_token,
             **{f"engine.{name}": getattr(profile.engine, name)
                for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "num_kv_blocks")}}
    return next((f"{name} is {value}, below 1" for name, value in sizes.items() if value < 1), "")


def least_squares(features: list[dict[str, float]], seconds: list[float], names: list[str]) -> Fit:
    """Least squares of the relative error (each point weighted by 1 / its seconds) on the named features, none
    negative (a term that fits below zero is noise: it is dropped and the rest refitted); R^2 and mean relative
    error over the points.

    Relative, because the points span two orders of magnitude (a 16-token prompt against 2,048 tokens) and the
    simulator's errors are read as ratios. In absolute seconds the longest points decide every coefficient: on
    the CPU demo model the prefill intercept fitted below zero, was dropped, and the per-token term took its
    place, pricing a 16-token prompt at 40% of its time and a mixed step's prompt tokens too high."""
    if len(seconds) < len(names):
        raise ProfileError(f"{len(seconds)} points cannot fit {len(names)} coefficients ({', '.join(names)}): "
                           "measure more points")
    matrix = np.array([[point[name] for name in names] for point in features], dtype=np.float64)
    target = np.asarray(seconds, dtype=np.float64)
    weight = 1.0 / np.maximum(target, 1e-12)  # (points,)
    active = list(range(len(names)))
    coefficients = np.zeros(len(names))
    while active:
        solution, *_ = np.linalg.lstsq(matrix[:, active] * weight[:, None], target * weight, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    predicted = matrix @ coefficients
    total = float(np.sum((target - target.mean()) ** 2))
    r2 = 1.0 - float(np.sum((target - predicted) ** 2)) / total if total > 0 else 1.0
    relative = float(np.mean(np.abs(predicted - target) / np.maximum(target, 1e-12)))
    return Fit(coefficients={n: float(c) for n, c in zip(names, coefficients)}, r2=r2,
               mean_relative_error=relative, num_points=len(seconds))


CLOCKS = ("wall", "cpu")


def step_time(point: PrefillPoint | DecodePoint, clock: str) -> float:
    return point.cpu_seconds if clock == "cpu" else point.seconds


def transfer_time(point: TransferPoint, clock: str) -> float:
    """Wall time, or on the cpu clock the busier side's CPU time (the two sides work as a pipeline)."""
    return max(point.sender_cpu_s, point.receiver_cpu_s) if clock == "cpu" else point.seconds


def fit_prefill(points: list[PrefillPoint], clock: str = "wall") -> Fit:
    rows = [{"intercept": 1.0, "tokens": p.tokens, "attention": p.attention} for p in points]
    return least_squares(rows, [step_time(p, clock) for p in points], ["intercept", "tokens", "attention"])


def fit_decode(points: list[DecodePoint], clock: str = "wall", pads_to_longest: bool = True) -> Fit:
    rows = [{"intercept": 1.0, "batch": p.batch, "context": p.attended(pads_to_longest)} for p in points]
    return least_squares(rows, [step_time(p, clock) for p in points], ["intercept", "batch", "context"])


def fit_transfer(points: list[TransferPoint], clock: str = "wall") -> Fit:
    rows = [{"intercept": 1.0, "bytes": p.bytes} for p in points]
    return least_squares(rows, [transfer_time(p, clock) for p in points], ["intercept", "bytes"])


def cpu_per_byte(points: list[TransferPoint], side: str) -> float:
    """CPU seconds per byte on one side of the link (through the origin: the per-message cost is small).
    side: "sender" or "receiver" (the process), "sender_thread" or "receiver_thread" (the thread that sent)."""
    total_bytes = sum(p.bytes for p in points)
    return sum(getattr(p, f"{side}_cpu_s") for p in points) / total_bytes if total_bytes else 0.0


def build_profile(model: ModelIdentity, machine: dict, engine: EngineSettings, prefill: list[PrefillPoint],
                  decode: list[DecodePoint], transfer: list[TransferPoint], clock: str = "wall",
                  capability: DeviceCapability | None = None) -> Profile:
    if clock not in CLOCKS:
        raise ProfileError(f"clock {clock!r} is unknown: use one of {', '.join(CLOCKS)}")
    return Profile(model=model, machine=machine, engine=engine, prefill_points=prefill, decode_points=decode,
                   transfer_points=transfer, prefill_fit=fit_prefill(prefill, clock),
                   decode_fit=fit_decode(decode, clock, engine.decode_pads_to_longest),
                   transfer_fit=fit_transfer(transfer, clock), clock=clock,
                   transfer_sender_cpu_per_byte=cpu_per_byte(transfer, "sender"),
                   transfer_receiver_cpu_per_byte=cpu_per_byte(transfer, "receiver"), capability=capability)
