"""KV layout fingerprint: what two engines must agree on before one accepts the other's KV,
exchanged once per link (Hello / HelloAck); a mismatch refuses the link naming every differing
field. `hash_weights_file` fingerprints weights cheaply (how: docs/design/kv-link.md)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pdserve.control.errors import ProtocolError
from pdserve.kvtransfer.errors import LayoutMismatchError, WeightsHashError

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True, kw_only=True)
class LayoutFingerprint:
    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int  # per engine (after tensor parallel sharding, if any)
    head_dim: int
    dtype: str  # KV cache dtype, torch attribute name: "bfloat16"
    block_size: int  # tokens per KV block
    weights_hash: str  # hash_weights_file(model dir)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = int if f.type == "int" else str
            if type(value) is not expected:
                raise ValueError(f"fingerprint.{f.name}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
            if expected is int and value <= 0:
                raise ValueError(f"fingerprint.{f.name}={value} must be a positive count")

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
        """One line per differing field, with both values: "dtype: local='bfloat16' remote='float16'"."""
        return [
            f"{f.name}: {labels[0]}={getattr(self, f.name)!r} {labels[1]}={getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def check_compatible(local: LayoutFingerprint, remote: LayoutFingerprint) -> None:
    """Raise LayoutMismatchError naming each difference when remote's KV cannot be used here."""
    differences = local.diff(remote)
    if differences:
        raise LayoutMismatchError(
            f"KV layout mismatch with the remote engine ({'; '.join(differences)}): run prefill and decode "
            f"engines with the same model weights, KV dtype and block size", differences)


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
    """The fingerprint of an engine from its ModelConfig (duck-typed: kvtransfer does not import engine)."""
    return LayoutFingerprint(
        architecture=model_config.architecture,
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=str(model_config.dtype).removeprefix("torch."),
        block_size=block_size,
        weights_hash=hash_weights_file(model_config.model_dir),
    )
