"""KV layout fingerprint: what two engines must agree on before one accepts the other's KV,
exchanged once per link (Hello / HelloAck); a mismatch refuses the link naming every differing
field, and for per-layer windows every differing layer. `hash_weights_file` fingerprints weights
cheaply (how: docs/design/kv-link.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pdserve.control.errors import ProtocolError
from pdserve.kvtransfer.errors import LayoutMismatchError, WeightsHashError
from pdserve.kvtransfer.layout import LinkLayout, format_windows, parse_windows

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_WINDOWS_LEN = 4096  # characters of layer_windows, checked before it is parsed


@dataclass(frozen=True, kw_only=True)
class LayoutFingerprint:
    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int  # per engine (after tensor parallel sharding, if any); 1 for a latent (MLA) cache
    head_dim: int  # the values per head and token; an MLA cache's latent width
    dtype: str  # KV cache dtype, torch attribute name: "bfloat16"
    block_size: int  # tokens per KV block
    weights_hash: str  # hash_weights_file(model dir)
    kv_planes: int = 2  # per layer: 2 (K and V) or 1 (an MLA latent)
    # each layer's sliding window in tokens or "full", comma separated, runs written once ("4096*5,full");
    # "" stands for every layer full (kvtransfer.layout.parse_windows)
    layer_windows: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = int if f.type == "int" else str
            if type(value) is not expected:
                raise ValueError(f"fingerprint.{f.name}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
            if expected is int and value <= 0:
                raise ValueError(f"fingerprint.{f.name}={value} must be a positive count")
        if self.kv_planes not in (1, 2):
            raise ValueError(f"fingerprint.kv_planes={self.kv_planes} must be 2 (K and V) or 1 (a latent)")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", format_windows((None,) * self.num_layers))
        self._check_windows()

    def _check_windows(self) -> None:
        if len(self.layer_windows) > MAX_WINDOWS_LEN:
            raise ValueError(f"fingerprint.layer_windows is {len(self.layer_windows)} characters, over {MAX_WINDOWS_LEN}")
        windows = parse_windows(self.layer_windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"fingerprint.layer_windows describes {len(windows)} layers, not {self.num_layers}")
        object.__setattr__(self, "layer_windows", format_windows(windows))  # one spelling per layout

    @property
    def windows(self) -> tuple[int | None, ...]:
        """[num_layers]: each layer's sliding window, None for full attention."""
        return parse_windows(self.layer_windows)

    def link_layout(self) -> LinkLayout:
        return LinkLayout(self.windows, self.block_size)

    def to_dict(self) -> dict[str, str | int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutFingerprint:
        """Parse a peer's fingerprint; raises ProtocolError naming missing, unknown or bad fields."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in names if name not in data]
        unknown = sorted(str(key) for key in data if key not in names)
        if missing or unknown:
            raise ProtocolError(f"layout fingerprint: missing field(s) {missing}, unexpected field(s) {unknown}; "
                                f"expected exactly {names}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ProtocolError(f"layout fingerprint: {exc}") from exc

    def diff(self, other: LayoutFingerprint, labels: tuple[str, str] = ("local", "remote")) -> list[str]:
        """One line per differing field, with both values: "dtype: local='bfloat16' remote='float16'"; per-layer
        windows name each differing layer."""
        lines = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine == theirs:
                continue
            if f.name == "layer_windows" and self.num_layers == other.num_layers:
                lines.append(_windows_diff(self.windows, other.windows, labels))
            else:
                lines.append(f"{f.name}: {labels[0]}={mine!r} {labels[1]}={theirs!r}")
        return lines


MAX_LAYERS_NAMED = 8  # a windows difference names this many layers, then counts the rest


def _windows_diff(mine: tuple[int | None, ...], theirs: tuple[int | None, ...], labels: tuple[str, str]) -> str:
    """ "layer_windows differ at layers 1, 3: local 1=full 3=full, remote 1=4096 3=4096" """
    def name(window: int | None) -> str:
        return "full" if window is None else str(window)

    layers = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    shown, more = layers[:MAX_LAYERS_NAMED], len(layers) - MAX_LAYERS_NAMED
    tail = f" (and {more} more)" if more > 0 else ""
    return (f"layer_windows differ at layers {', '.join(map(str, shown))}{tail}: "
            f"{labels[0]} {' '.join(f'{i}={name(mine[i])}' for i in shown)}, "
            f"{labels[1]} {' '.join(f'{i}={name(theirs[i])}' for i in shown)}")


def check_compatible(local: LayoutFingerprint, remote: LayoutFingerprint) -> None:
    """Raise LayoutMismatchError naming each difference when remote's KV cannot be used here."""
    differences = local.diff(remote)
    if differences:
        raise LayoutMismatchError(
            f"KV layout mismatch with the remote engine ({'; '.join(differences)}): run prefill and decode "
            f"engines with the same model weights, KV dtype, block size and attention windows", differences)


# ---- weights hash ----

def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise WeightsHashError(f"no *.safetensors weights at {path}: pass a model directory (or file) "
                               f"with safetensors weights")
    return files


def _sample_offsets(data_len: int) -> list[int]:
    if data_len <= SAMPLES_PER_FILE * SAMPLE_BYTES:
        return list(range(0, data_len, SAMPLE_BYTES))
    last_start = data_len - SAMPLE_BYTES  # the first sample starts the data, the last one ends it
    return [i * last_start // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)]


def _hash_one(path: Path, file: BinaryIO, digest: Any) -> None:
    size = path.stat().st_size
    head = file.read(8)
    header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 <= header_len <= min(MAX_SAFETENSORS_HEADER, size - 8):
        raise WeightsHashError(f"{path} is not a safetensors file (bad header length): re-download or "
                               f"re-convert the weights")
    digest.update(size.to_bytes(8, "little") + head + file.read(header_len))
    data_start = 8 + header_len
    for offset in _sample_offsets(size - data_start):
        file.seek(data_start + offset)
        digest.update(file.read(SAMPLE_BYTES))


def hash_weights_file(path_or_dir: str | Path) -> str:
    """Cheap stable hex digest of a model's safetensors weights (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in _safetensors_files(Path(path_or_dir)):
        with open(path, "rb") as file:
            _hash_one(path, file, digest)
    return digest.hexdigest()


def engine_fingerprint(model_config: Any, block_size: int) -> LayoutFingerprint:
    """The fingerprint of an engine from its ModelConfig (duck-typed: kvtransfer does not import engine).
    The per-token shape and planes are the ones a K/V cache has; `for_cache` takes them from the cache."""
    windows = [model_config.sliding_window_of(layer) for layer in range(model_config.num_layers)]
    return LayoutFingerprint(
        architecture=model_config.architecture,
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=str(model_config.dtype).removeprefix("torch."),
        block_size=block_size,
        weights_hash=hash_weights_file(model_config.model_dir),
        layer_windows=format_windows(windows),
    )


def for_cache(fingerprint: LayoutFingerprint, shape: tuple[int, ...]) -> LayoutFingerprint:
    """The fingerprint with its per-layer planes and per-token shape taken from the KV cache
    [num_layers, planes, num_blocks, block_size, *per_token] it describes: a latent (MLA) cache
    [L, 1, N, B, 1, width] is described as 1 plane of 1 x width."""
    num_layers, _, _, block_size = shape[:4]
    if (num_layers, block_size) != (fingerprint.num_layers, fingerprint.block_size):
        raise ValueError(f"KV cache {list(shape)} does not hold the fingerprint's {fingerprint.num_layers} layers "
                         f"in blocks of {fingerprint.block_size} tokens")
    return dataclasses.replace(fingerprint, kv_planes=shape[1], num_kv_heads=shape[4], head_dim=math.prod(shape[5:]))
