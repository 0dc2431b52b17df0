"""Mixture-of-experts feed-forward: a router picks the top-k experts of each token (softmax top-k, or
DeepSeek's group-limited top-k), the chosen experts run as two grouped GEMMs over
the (token, expert) pairs sorted by expert, and each token sums its experts' outputs weighted by the
router; an optional shared expert, scaled by a sigmoid gate, is added.

Expert weights are held fused, in transformers 5's in-memory layout: gate_up_proj [E, 2I, H] (gate
rows, then up rows) and down_proj [E, H, I]. A checkpoint tensor of one expert loads into its rows
with shard id (expert, "gate" | "up" | "down"); a fused tensor loads whole (shard id None). On a CPU with
AVX512-BF16, bfloat16 experts are packed after loading for pdserve's kernel (pack_expert_weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ConfigError
from pdserve.engine.layers.linear import Linear, copy_checked, default_weight_loader
from pdserve.kernels import cpu_grouped_gemm
from pdserve.kernels.cpu_grouped_gemm import PackedExperts
from pdserve.kernels.cpu_norm_rotary import silu_and_mul
from pdserve.kernels.dispatch import kernel_for


@dataclass(frozen=True)
class MoESpec:
    """The shape and routing of a model's sparse feed-forward layers."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral always; Qwen when norm_topk_prob)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP (False)


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] float32, expert ids [T, k] int64)
    """Softmax over all experts in float32, then the k largest; renormalised to sum to 1 if asked."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def select_experts_grouped(
    router_logits: torch.Tensor,  # [T, E] float32
    correction_bias: torch.Tensor | None,  # [E] float32, shifts which experts are chosen, not their weights
    top_k: int,
    num_groups: int,
    top_k_groups: int,
    renormalize: bool,
    scaling_factor: float,
    sigmoid: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] float32, expert ids [T, k] int64)
    """DeepSeek's group-limited routing. The experts split into num_groups equal groups; the k best (biased)
    scores among the top_k_groups best groups win. DeepSeek-V3 (sigmoid): sigmoid scores, a group scored by
    the sum of its two best biased scores. DeepSeek-V2 (softmax): softmax scores, a group by its best one.
    The weights are the unbiased scores, renormalised to sum to 1 if asked, times scaling_factor."""
    scores = router_logits.float().sigmoid() if sigmoid else router_logits.float().softmax(dim=-1)
    biased = scores if correction_bias is None else scores + correction_bias.float()
    grouped = biased.view(biased.shape[0], num_groups, -1)  # [T, G, E / G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if sigmoid else grouped.amax(dim=-1)  # [T, G]
    best_groups = group_scores.topk(top_k_groups, dim=-1, sorted=False).indices  # [T, top_k_groups]
    in_best_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    candidates = grouped.masked_fill(~in_best_group[:, :, None], float("-inf")).flatten(1)  # [T, E]
    expert_ids = candidates.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, expert_ids


class NarrowLinear(Linear):
    """A linear with few outputs (a router's, one per expert; a shared-expert gate's, one), kept on F.linear: at
    these widths oneDNN's packed call costs more than the product (docs/design/attention-features.md)."""

    def pack_for_cpu(self, keep_weight: bool) -> bool:
        return False


class GroupLimitedRouter(nn.Module):
    """DeepSeek's router under Hugging Face's names (mlp.gate.weight, and DeepSeek-V3's
    mlp.gate.e_score_correction_bias), kept and computed in float32 as transformers keeps them."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_groups: int, top_k_groups: int,
                 renormalize: bool, scaling_factor: float, sigmoid: bool = True) -> None:
        super().__init__()
        if num_experts % num_groups or (sigmoid and num_experts // num_groups < 2) or not 1 <= top_k_groups <= num_groups:
            raise ConfigError(f"group-limited routing needs n_routed_experts ({num_experts}) split into n_group "
                              f"({num_groups}) equal groups (of at least 2 experts with sigmoid scores), and "
                              f"1 <= topk_group ({top_k_groups}) <= n_group: fix config.json")
        self.top_k, self.num_groups, self.top_k_groups = top_k, num_groups, top_k_groups
        self.renormalize, self.scaling_factor, self.sigmoid = renormalize, scaling_factor, sigmoid
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias = None
        if sigmoid:  # DeepSeek-V3's scores come with a correction bias
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> ([T, k], [T, k])
        logits = F.linear(hidden.float(), self.weight)  # [T, E]
        return select_experts_grouped(logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                      self.top_k_groups, self.renormalize, self.scaling_factor, self.sigmoid)


class ExpertWeights(nn.Module):
    """Every expert's gated MLP, applied to the tokens routed to it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self._load
            param.shard_ids = [(expert, part) for expert in range(num_experts) for part in parts]
        self.register_buffer("expert_range", torch.arange(num_experts), persistent=False)
        self.packed: tuple[PackedExperts, PackedExperts] | None = None  # (gate_up, down), set by pack_for_cpu

    def pack_for_cpu(self) -> bool:
        """Pack gate_up_proj and down_proj for pdserve's bf16 CPU kernel and release them (the memory does not
        double). False if they stay as they are (not bfloat16 on a CPU with AVX512-BF16)."""
        if not (cpu_grouped_gemm.supports(self.gate_up_proj) and cpu_grouped_gemm.supports(self.down_proj)):
            return False
        self.packed = (cpu_grouped_gemm.pack_experts(self.gate_up_proj.data),
                       cpu_grouped_gemm.pack_experts(self.down_proj.data))
        self.gate_up_proj = self.down_proj = None
        return True

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None,
              name: str = "") -> None:
        if shard_id is None:  # fused in the checkpoint already
            copy_checked(param.data, loaded, name)
            return
        expert, part = shard_id
        rows = param.data[expert]
        if part != "down":
            size = self.intermediate_size
            rows = rows.narrow(0, 0 if part == "gate" else size, size)
        copy_checked(rows, loaded, name)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        routing_weights: torch.Tensor,  # [T, k]
        expert_ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        gate_up, down = self.packed or (self.gate_up_proj, self.down_proj)
        return routed_experts(hidden, routing_weights, expert_ids, gate_up, down, silu_and_mul, self.expert_range)


def pack_expert_weights(model: nn.Module) -> int:
    """Pack every ExpertWeights of the model once, after loading (see ExpertWeights.pack_for_cpu); returns how many
    were packed."""
    return sum(module.pack_for_cpu() for module in model.modules() if isinstance(module, ExpertWeights))


def routed_experts(
    hidden: torch.Tensor,  # [T, H]
    routing_weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k]
    gate_up_proj: torch.Tensor | PackedExperts,  # [E, 2I, H]
    down_proj: torch.Tensor | PackedExperts,  # [E, H, I]
    activation: Callable[[torch.Tensor], torch.Tensor],  # [M, 2I] -> [M, I]
    expert_range: torch.Tensor,  # [E] arange, on hidden's device
) -> torch.Tensor:  # [T, H]
    """Each token's routed experts as two grouped GEMMs over its (token, expert) pairs sorted by expert; packed
    weights run on pdserve's bf16 CPU kernel (kernels/cpu_grouped_gemm.py)."""
    if isinstance(gate_up_proj, PackedExperts):
        grouped_gemm = cpu_grouped_gemm.grouped_gemm
    else:
        grouped_gemm = kernel_for("grouped_gemm", hidden.device)
    num_tokens, top_k = expert_ids.shape
    sorted_ids, order = expert_ids.flatten().sort(stable=True)  # [T * k] pairs by expert; pair p is token p // k
    # expert e's pairs end where the sorted ids first exceed e (no host sync: CUDA-graph safe)
    group_ends = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)  # [E]
    gate_up = grouped_gemm(hidden[order // top_k], gate_up_proj, group_ends)  # [T * k, 2I]
    down = grouped_gemm(activation(gate_up).contiguous(), down_proj, group_ends)  # [T * k, H]
    # back in (token, slot) order: row i of `down` belongs to pair order[i] (a permutation: no scatter-add)
    unsorted = torch.empty_like(down).index_copy_(0, order, down).view(num_tokens, top_k, -1)  # [T, k, H]
    return unsorted.mul_(routing_weights.to(down.dtype)[:, :, None]).sum(dim=1)


class SparseMoE(nn.Module):
    """Router + experts (+ shared expert), under Hugging Face's names: gate, experts, shared_expert,
    shared_expert_gate."""

    def __init__(self, hidden_size: int, spec: MoESpec, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = NarrowLinear(hidden_size, spec.num_experts)  # the router
        self.experts = ExpertWeights(spec.num_experts, hidden_size, spec.expert_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = NarrowLinear(hidden_size, 1) if shared_expert is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, expert_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        out = self.experts(hidden, weights, expert_ids)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out
