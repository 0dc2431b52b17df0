"""Model classes by the Hugging Face `architectures` name, and the choice of implementation.

model_impl (ModelConfig.model_impl):
  native        pdserve's own code (NATIVE_MODELS) or an error
  transformers  the transformers backend: transformers' layers, attention on pdserve's KV cache
                (TransformersMoEForCausalLM for mixture-of-experts configs: experts on pdserve's grouped GEMM)
  auto          native when pdserve has the architecture, else the transformers backend when
                transformers has a causal LM class of that name, else an error naming both lists
"""

from __future__ import annotations

import importlib

from torch import nn

from pdserve.engine.config import ModelConfig

# architecture name -> the module defining the class of that name (imported only when that architecture loads)
NATIVE_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pdserve.engine.models.llama",
    "MistralForCausalLM": "pdserve.engine.models.llama",
    "Qwen2ForCausalLM": "pdserve.engine.models.llama",
    "Qwen3ForCausalLM": "pdserve.engine.models.llama",
    "MixtralForCausalLM": "pdserve.engine.models.sparse_moe",
    "Qwen2MoeForCausalLM": "pdserve.engine.models.sparse_moe",
    "Qwen3MoeForCausalLM": "pdserve.engine.models.sparse_moe",
    "DeepseekV2ForCausalLM": "pdserve.engine.models.deepseek_v3",
    "DeepseekV3ForCausalLM": "pdserve.engine.models.deepseek_v3",
}


def native_model_class(architecture: str) -> type[nn.Module]:
    return getattr(importlib.import_module(NATIVE_MODELS[architecture]), architecture)


def is_native(model: nn.Module) -> bool:
    """Whether the model is pdserve's own code (not the transformers backend)."""
    return NATIVE_MODELS.get(type(model).__name__) == type(model).__module__


class UnsupportedArchitectureError(ValueError):
    pass


def transformers_causal_lm_names() -> frozenset[str]:
    """Class names of every causal LM transformers can build from a config (no remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def resolve_model_class(config: ModelConfig) -> type[nn.Module]:
    architecture, impl = config.architecture, config.model_impl
    if architecture in NATIVE_MODELS and impl != "transformers":
        return native_model_class(architecture)
    if impl == "native":
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} has no native pdserve implementation; native: "
            f"{', '.join(sorted(NATIVE_MODELS))}. Pass model_impl='auto' or 'transformers' (--model-impl) "
            "to run it through the transformers backend"
        )
    if architecture in transformers_causal_lm_names():
        # imports transformers' modeling code lazily
        from pdserve.engine.models.transformers_backend import TransformersForCausalLM
        from pdserve.engine.models.transformers_moe import TransformersMoEForCausalLM, is_moe_config

        return TransformersMoEForCausalLM if is_moe_config(config.hf_config) else TransformersForCausalLM
    import transformers

    raise UnsupportedArchitectureError(
        f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(NATIVE_MODELS))} natively, "
        f"and through the transformers backend any causal LM class of transformers {transformers.__version__} "
        "(this name is not one; models that need trust_remote_code are not supported)"
    )
