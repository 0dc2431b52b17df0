"""The model's own sampling defaults from its generation_config.json, as vLLM applies them: a value the
request leaves unset takes the model's default (max_new_tokens is the default max_tokens); a value
the request sets wins. Torch-free: the router and the offline API both read it."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

from pdserve.engine.hub import cache_only, is_hub_id

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_KEYS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
         "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams defaults the model asks for; None = the model says nothing (pdserve's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    def as_kwargs(self) -> dict[str, float | int]:
        """Only the values the model set, as SamplingParams keyword arguments (a copy)."""
        return dict(self._set_values)

    @cached_property
    def _set_values(self) -> dict[str, float | int]:  # once: fill() runs for every request
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def fill(self, requested: dict[str, object], fields_set: set[str]) -> dict[str, object]:
        """`requested` with each of its fields the request did not set replaced by the model's default."""
        return {**requested, **{k: v for k, v in self._set_values.items() if k in requested and k not in fields_set}}

    @classmethod
    def from_dict(cls, generation: dict) -> GenerationDefaults:
        from pdserve.control.errors import InvalidSamplingParams
        from pdserve.control.sampling_params import SamplingParams

        values = {}
        for key, name in _KEYS.items():
            value = generation.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue  # absent, null or malformed (JSON's NaN, Infinity): the model does not set it
            value = int(value) if name in ("max_tokens", "top_k") else float(value)
            try:  # out of range, it would turn every request that leaves it unset into a 400
                SamplingParams(**{name: value})
            except InvalidSamplingParams as exc:
                logger.warning("ignoring generation_config.json's %s=%s (%s): requests that do not set %s get "
                               "pdserve's default", key, value, exc, name)
                continue
            values[name] = value
        return cls(**values)


def load_generation_defaults(model: str | Path) -> GenerationDefaults:
    """The defaults in a model directory's (or a hub id's) generation_config.json; none when there
    is no such file or it cannot be read (a warning says so)."""
    path = _generation_config_path(model)
    if path is None:
        return GenerationDefaults()
    try:
        return GenerationDefaults.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("ignoring %s (%s): using pdserve's sampling defaults", path, exc)
        return GenerationDefaults()


def _generation_config_path(model: str | Path) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        candidate = path / "generation_config.json"
        return candidate if candidate.is_file() else None
    if not is_hub_id(model):
        return None
    from huggingface_hub import hf_hub_download

    try:  # a hub id: fetched like its tokenizer (or found in the HF cache when offline)
        return Path(hf_hub_download(str(model), "generation_config.json", local_files_only=cache_only()))
    except Exception:  # noqa: BLE001 - no such file, no network, a malformed id: no defaults to read
        return None
