"""The transformers backend for mixture-of-experts models: TransformersMoEForCausalLM.

transformers' MoE layers keep their own routers. Their experts (modules transformers decorates with
use_experts_implementation) run pdserve's grouped expert computation (engine/layers/moe.py, Triton
on CUDA) through `pdserve_experts`, registered with transformers' ExpertsInterface. A model whose
experts differ from the plain layout (biases, transposed or interleaved weights, no gate, a norm
after each expert) keeps transformers' own experts implementation.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.moe import routed_experts
from pdserve.engine.models.transformers_backend import TransformersForCausalLM

EXPERTS_IMPLEMENTATION = "pdserve"
# config.json fields that give a model's number of routed experts, across transformers' MoE families
_NUM_EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def pdserve_experts(
    module: nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    expert_range = torch.arange(module.num_experts, device=hidden_states.device)
    return routed_experts(hidden_states, top_k_weights, top_k_index, module.gate_up_proj, module.down_proj,
                          module._apply_gate, expert_range)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, pdserve_experts)


def is_moe_config(hf_config: dict) -> bool:
    return any(isinstance(hf_config.get(f), int) and hf_config[f] > 0 for f in _NUM_EXPERTS_FIELDS)


def _plain_experts(module: nn.Module) -> bool:
    """[E, 2I, H] gate|up and [E, H, I] down weights, gated, no biases, no per-expert norm."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and module.has_gate and module.is_concatenated and not module.is_transposed and not module.has_bias
            and not module.has_post_expert_norm and gate_up.shape[0] == down.shape[0] == module.num_experts)


def experts_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The modules transformers' use_experts_implementation decorated (they carry is_concatenated)."""
    return [m for m in hf_model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


class TransformersMoEForCausalLM(TransformersForCausalLM):
    """TransformersForCausalLM whose experts run on pdserve's grouped GEMM where their layout allows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        experts = experts_modules(self.hf_model)
        if experts and all(_plain_experts(m) for m in experts):
            self.hf_model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        self.experts_implementation = self.hf_model.config._experts_implementation
