"""Model classes by the Hugging Face `architectures` name."""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

NATIVE_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    pass


def resolve_model_class(config: ModelConfig) -> type[nn.Module]:
    model_class = NATIVE_MODELS.get(config.architecture)
    if model_class is None:
        raise UnsupportedArchitectureError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(sorted(NATIVE_MODELS))}"
        )
    return model_class
