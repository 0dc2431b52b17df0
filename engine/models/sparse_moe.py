"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (engine/models/llama.py) whose
feed-forward blocks are mixtures of experts (engine/layers/moe.py).

Each architecture reads its MoE shape from config.json: Mixtral routes every layer with renormalised
top-k weights; the Qwen models renormalise when norm_topk_prob is set and keep dense MLPs on the
layers that mlp_only_layers and decoder_sparse_step leave out; Qwen2-MoE adds a gated shared expert.
"""

from __future__ import annotations

from torch import nn

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.layers.moe import MoESpec, SparseMoE
from pdserve.engine.models.llama import ArchFlags, GatedMLP, LlamaForCausalLM


def _int_field(hf: dict, name: str, architecture: str, alias: str | None = None) -> int:
    """A positive integer field of config.json (or its alias: transformers 5 writes Qwen3-MoE's
    num_experts as num_local_experts)."""
    value = hf.get(name, hf.get(alias) if alias else None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{architecture} config.json needs a positive integer `{name}`, got {value!r}")
    return value


def _qwen_sparse_layers(hf: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """transformers' rule: layer i has experts unless listed in mlp_only_layers or off the sparse step."""
    dense = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step") or 1)
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


class _SparseMoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder with SparseMoE on the layers `moe_spec` marks sparse."""

    # per-expert checkpoint projection name -> which rows of the fused expert weights it fills
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    checkpoint_renames: dict[str, str] = {}  # checkpoint name fragment -> our module's name fragment

    @classmethod
    def moe_spec(cls, config: ModelConfig) -> MoESpec:
        raise NotImplementedError

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        activation = config.hf_config.get("hidden_act", "silu")
        if activation != "silu":
            raise ConfigError(f"{config.architecture} with hidden_act={activation!r}: pdserve's experts are SiLU-gated; "
                              "run it with model_impl='transformers' (--model-impl transformers)")
        spec = self.moe_spec(config)
        if not spec.sparse_layers[layer_idx]:
            return GatedMLP(config)
        shared = None
        if spec.shared_expert_intermediate_size:
            shared = GatedMLP(config, spec.shared_expert_intermediate_size)
        return SparseMoE(config.hidden_size, spec, shared)


class MixtralForCausalLM(_SparseMoEForCausalLM):
    flags = ArchFlags()
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def moe_spec(cls, config: ModelConfig) -> MoESpec:
        hf, name = config.hf_config, config.architecture
        return MoESpec(
            num_experts=_int_field(hf, "num_local_experts", name),
            top_k=_int_field(hf, "num_experts_per_tok", name),
            expert_intermediate_size=config.intermediate_size,
            renormalize=True,
            sparse_layers=(True,) * config.num_layers,
        )


class Qwen3MoeForCausalLM(_SparseMoEForCausalLM):
    flags = ArchFlags(qk_norm=True)

    @classmethod
    def moe_spec(cls, config: ModelConfig) -> MoESpec:
        hf, name = config.hf_config, config.architecture
        num_experts = _int_field(hf, "num_experts", name, alias="num_local_experts")
        return MoESpec(
            num_experts=num_experts,
            top_k=_int_field(hf, "num_experts_per_tok", name),
            expert_intermediate_size=_int_field(hf, "moe_intermediate_size", name),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=cls.shared_expert_size(hf),
            sparse_layers=_qwen_sparse_layers(hf, config.num_layers, num_experts),
        )

    @classmethod
    def shared_expert_size(cls, hf: dict) -> int:
        return 0


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    flags = ArchFlags(qkv_bias=True)

    @classmethod
    def shared_expert_size(cls, hf: dict) -> int:
        return _int_field(hf, "shared_expert_intermediate_size", "Qwen2MoeForCausalLM")
