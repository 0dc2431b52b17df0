"""Hugging Face model directory (or hub id) -> pdserve nn.Module with every parameter loaded exactly once."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.hub import cache_only, hub_failure, is_hub_id
from pdserve.engine.layers.linear import pack_linear_weights
from pdserve.engine.layers.moe import pack_expert_weights
from pdserve.engine.models.registry import resolve_model_class

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
log = logging.getLogger("pdserve.loader")


class ModelLoadError(ValueError):
    """The model directory or its weights cannot be used; the message names the file or tensor."""


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub id fetched (or found in the local HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(model):
        what = "is not a directory" if path.exists() else "does not exist"
        raise ModelLoadError(f"model {str(model)!r} {what} and is not a Hugging Face hub id (org/name): pass a "
                             f"model directory (config.json + *.safetensors + tokenizer), a hub id, or no model for "
                             f"the built-in demo model")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=_HUB_PATTERNS, local_files_only=cache_only()))
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds; all mean "not available"
        raise ModelLoadError(hub_failure(str(model), "the model", exc)) from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}; re-download the model")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir}: pdserve loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def iterate_weights(model_dir: Path, skip: Callable[[str], bool] = lambda name: False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint but those `skip` names (never read); a progress bar on a terminal
    (none in a log file)."""
    from tqdm import tqdm

    files = safetensors_files(model_dir)
    with tqdm(total=sum(f.stat().st_size for f in files), desc="loading weights", unit="B", unit_scale=True,
              disable=None, leave=False) as bar:
        for file in files:
            yield from _file_weights(file, bar, skip)


def _file_weights(file: Path, bar, skip: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if skip(name):
                    continue
                tensor = handle.get_tensor(name)
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor
    except Exception as exc:  # safetensors raises its own error type for truncated/corrupt files
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(
            f"cannot read weights file {file} ({exc}): it is truncated or corrupt; re-download it"
        ) from exc


# One expert's projection in a hub MoE checkpoint, e.g. model.layers.0.mlp.experts.3.gate_proj.weight
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight$")


def _expert_target(name: str, projections: dict[str, str]) -> tuple[str, object] | None:
    """A per-expert tensor -> (the fused expert parameter, (expert, part)); None for other names."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["projection"] not in projections:
        return None
    part = projections[match["projection"]]
    fused = "down_proj" if part == "down" else "gate_up_proj"
    return f"{match['experts']}.{fused}", (int(match["expert"]), part)


def _target_of(name: str, packed: dict[str, tuple[str, object]], model: nn.Module) -> tuple[str, object]:
    """Checkpoint name -> (our parameter name, shard id or None)."""
    for fragment, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(fragment, ours)
    expert = _expert_target(name, getattr(model, "expert_projections", {}))
    if expert is not None:
        return expert
    for fragment, (fused, shard_id) in packed.items():
        token = f".{fragment}."
        if token in name:
            return name.replace(token, f".{fused}."), shard_id
    return name, None


def _expected_loads(model: nn.Module) -> set[tuple[str, object]]:
    expected = set()
    for name, param in model.named_parameters():  # tied parameters appear once
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        shards = getattr(param, "shard_ids", None) or getattr(owner, "shard_offsets", None)
        expected.update((name, shard) for shard in shards) if shards else expected.add((name, None))
    return expected


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = model.config.tie_word_embeddings
    loaded: set[tuple[str, object]] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # recomputed / shared with the embedding
        target, shard_id = _target_of(name, packed, model)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint has unexpected tensor {name}: it does not belong to {type(model).__name__}")
        if (target, shard_id) in loaded:
            raise ModelLoadError(f"checkpoint holds tensor {name} twice; the model directory is inconsistent")
        if param.is_floating_point() and not tensor.is_floating_point():  # a cast would load garbage silently
            raise ModelLoadError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}, not a "
                                 f"floating-point weight: pdserve loads float32, bfloat16 and float16 checkpoints "
                                 f"(quantized ones are not supported): use the model's unquantized weights")
        param.weight_loader(param, tensor, shard_id, name)
        loaded.update(_shards_filled(param, target, shard_id))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in _expected_loads(model) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")


class ExtraLayerSkip:
    """skip(name) for a model that sets skips_layers_past_num_layers: True for tensors of layers at index >=
    num_hidden_layers (DeepSeek's multi-token-prediction layers), which it notes to log once."""

    def __init__(self, model: nn.Module) -> None:
        self.enabled = bool(getattr(model, "skips_layers_past_num_layers", False))
        self.num_layers = model.config.num_layers if self.enabled else 0
        self.skipped: set[int] = set()

    def __call__(self, name: str) -> bool:
        match = _LAYER_INDEX.match(name) if self.enabled else None
        if match is None or int(match[1]) < self.num_layers:
            return False
        self.skipped.add(int(match[1]))
        return True

    def log_skipped(self) -> None:
        if self.skipped:
            log.info("skipped the checkpoint's layers %s (past num_hidden_layers = %d: multi-token-prediction "
                     "layers, which pdserve does not run)", sorted(self.skipped), self.num_layers)


def _shards_filled(param: nn.Parameter, target: str, shard_id: object) -> list[tuple[str, object]]:
    """What one load fills: its shard, or every shard of a parameter whose checkpoint holds it fused."""
    shard_ids = getattr(param, "shard_ids", None)
    if shard_id is None and shard_ids:
        return [(target, shard) for shard in shard_ids]
    return [(target, shard_id)]


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    model_class = resolve_model_class(config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    skip = ExtraLayerSkip(model)
    weights = iterate_weights(Path(config.model_dir), skip)
    if hasattr(model, "load_weights"):  # a model that maps checkpoint names itself (transformers backend)
        model.load_weights(weights)
    else:
        load_weights(model, weights)
        pack_linear_weights(model)  # CPU: oneDNN layout, see engine/layers/linear.py
        pack_expert_weights(model)  # CPU bf16 experts: pdserve's kernel, see engine/layers/moe.py
    skip.log_skipped()
    return model.eval()
