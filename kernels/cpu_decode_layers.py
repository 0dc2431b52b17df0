"""A decode step's Llama-family decoder layers in one native call (cpu_decode_layers.c, built by kernels.cpu_native):
the bf16 products, norms, rotary, KV store and paged decode attention that the layers call one by one from Python,
called in the same order from C, so the output is bit-for-bit the same without the Python between them.

`available()` is False where any of those kernels is (no compiler, PDSERVE_CPU_KERNEL=torch, no AVX512-BF16); the
layers then run one by one. engine/models/cpu_decode_layers.py decides which models and steps take it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels import cpu_gemm, cpu_native, cpu_norm_rotary

SOURCE = Path(__file__).with_name("cpu_decode_layers.c")

_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_FUNCTIONS = {
    "pdserve_decode_layers_bf16": (_INT, [_POINTER, _POINTER, _INT, _POINTER, _FLOAT, _FLOAT, _POINTER, _POINTER,
                                          _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _POINTER, _INT,
                                          _INT]),
    "pdserve_decode_layers_bf16_fields": (_INT, []),
}
ERRORS = {-1: "a bf16 product refused its shape (an odd input width)",
          -2: "the CPU decode attention kernel could not allocate its logits buffer",
          -3: "a KV slot past the cache: the step's slot_mapping is corrupt"}


def _kernel_addresses() -> torch.Tensor | None:  # int64 [6]: gemm, add_rms_norm, rotary, silu_mul, decode, store_kv
    gemm = cpu_gemm.packed_gemm()
    norm_rotary = cpu_native.functions(cpu_norm_rotary.SOURCE, cpu_norm_rotary._FUNCTIONS)
    decode = cpu_native.functions(cpu_native.SOURCE, cpu_native._DECODE)
    if gemm is None or norm_rotary is None or decode is None:
        return None
    functions = (gemm, *norm_rotary, *decode)
    return torch.tensor([ctypes.cast(function, ctypes.c_void_p).value for function in functions], dtype=torch.int64)


def available() -> bool:
    return cpu_native.functions(SOURCE, _FUNCTIONS) is not None and _kernel_addresses() is not None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors, as the layers hold them once loaded and bound (packed panels, bf16)."""
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # cpu_gemm.pack_weight panels of [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # panels of [hidden, H D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # panels of [2 I, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # panels of [hidden, I]
    down_bias: torch.Tensor | None
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] bf16, contiguous
    value_cache: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's per-head norms of q and k before rotary
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class StackShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecodeLayers:
    """The layers' addresses, read once; `run` takes one decode step through all of them."""

    def __init__(self, shape: StackShape, layers: list[LayerWeights]) -> None:
        self.call, fields_of = cpu_native.functions(SOURCE, _FUNCTIONS)
        fields = fields_of()
        rows = [[_address(getattr(layer, name)) for name in LayerWeights.__dataclass_fields__] for layer in layers]
        if any(len(row) != fields for row in rows):
            raise RuntimeError(f"cpu_decode_layers.c reads {fields} fields a layer: update LayerWeights to match")
        self.layers = layers  # keeps every addressed tensor alive
        self.table = torch.tensor(rows, dtype=torch.int64)  # [num_layers, fields]
        self.kernels = _kernel_addresses()
        cache = layers[0].key_cache
        self.shape = shape
        self.dims = torch.tensor([shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate,
                                  cache.shape[1], cache.shape[0] * cache.shape[1]], dtype=torch.int64)
        # qkv, rotated | attended | normed and a residual | gate_up and act | q/k heads before and after their norms
        heads, kv_heads = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.scratch_per_token = (heads + 2 * kv_heads + 3 * (heads + kv_heads) + heads + 2 * shape.hidden
                                  + 3 * shape.intermediate)

    def run(
        self,
        hidden: torch.Tensor,  # [T, hidden] bf16 contiguous: the embeddings (overwritten: a residual buffer)
        cos_sin: torch.Tensor,  # [T, head_dim] bf16 contiguous: cos | sin of each token's position
        slots: torch.Tensor,  # [T] int64 contiguous
        block_tables: torch.Tensor,  # [T, max_blocks] int32 contiguous
        seq_lens: torch.Tensor,  # [T] int32 contiguous, context including the new token
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (last layer's output, residual) [T, hidden] each
        tokens = hidden.shape[0]
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)
        scratch = torch.empty(tokens * self.scratch_per_token, dtype=torch.bfloat16)
        status = self.call(
            self.kernels.data_ptr(), self.table.data_ptr(), self.table.shape[0], self.dims.data_ptr(), self.shape.eps,
            self.shape.scale, hidden.data_ptr(), out.data_ptr(), residual.data_ptr(), scratch.data_ptr(),
            cos_sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
            tokens, torch.get_num_threads())
        if status != 0:
            raise (IndexError if status == -3 else MemoryError if status == -2 else ValueError)(ERRORS[status])
        return out, residual


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
