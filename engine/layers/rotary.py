"""Rotary position embedding (rotate-halves layout) with precomputed cos/sin tables.

Scalings: every static type transformers knows (linear, llama3, yarn, ..), through transformers' own
ROPE_INIT_FUNCTIONS; sequence-dependent types (dynamic, longrope) are refused.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

# Types whose frequencies change with the sequence length: one fixed table cannot hold them.
SEQUENCE_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")

# (query [T, H, D], key [T, Hkv, D]) -> both rotated: one step's rotation, applied by every layer
Rotation = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (positions [T], query, key, cos_sin_cache [max_positions, rotary_dim]) -> (query, key), like kernels.reference_extra
RotaryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (x [T, H, head_dim], cos, sin [T, 1, head_dim // 2]) -> rotated x, or None where it does not take these tensors
NativeRotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


class UnsupportedRopeError(ValueError):
    pass


@functools.cache
def supported_rope_types() -> tuple[str, ...]:
    """'default', then every static type of transformers' ROPE_INIT_FUNCTIONS (transformers is imported
    only for a model that names a scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default",) + tuple(t for t in ROPE_INIT_FUNCTIONS if t not in SEQUENCE_DEPENDENT_ROPE_TYPES)


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [head_dim // 2]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def rope_type_of(scaling: dict | None) -> str:
    """The scaling's type; older configs name it `type`."""
    scaling = scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _transformers_rope(rope_type: str, head_dim: int, theta: float, scaling: dict,
                       max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention factor) from transformers' own init function for `rope_type`,
    given a config holding just what those functions read."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PretrainedConfig()
    config.head_dim, config.hidden_size, config.num_attention_heads = head_dim, head_dim, 1
    config.max_position_embeddings = max_positions
    config.rope_parameters = {**scaling, "rope_type": rope_type, "rope_theta": theta}
    try:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    except KeyError as exc:
        raise UnsupportedRopeError(f"rope scaling {rope_type!r} needs {exc} in config.json's rope_scaling: "
                                   "restore the model's config.json") from exc
    if inv_freq.shape != (head_dim // 2,):
        raise UnsupportedRopeError(f"rope scaling {rope_type!r} rotates {2 * inv_freq.shape[0]} of {head_dim} dims "
                                   "(partial_rotary_factor); pdserve rotates whole heads: use --model-impl "
                                   "transformers")
    return inv_freq.float(), float(attention_factor)


def rope_parameters(head_dim: int, theta: float, scaling: dict | None,
                    max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention factor): cos and sin are multiplied by the factor, as in
    transformers' rotary (1.0 except for types such as yarn)."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return _base_inv_freq(head_dim, theta), 1.0
    if rope_type in supported_rope_types():
        return _transformers_rope(rope_type, head_dim, theta, scaling, max_positions)
    why = ("its frequencies change with the sequence length, which one precomputed table cannot hold"
           if rope_type in SEQUENCE_DEPENDENT_ROPE_TYPES else "neither pdserve nor transformers knows it")
    raise UnsupportedRopeError(
        f"rope scaling type {rope_type!r} is not supported by pdserve ({why}; supported: "
        f"{', '.join(supported_rope_types())}); use a checkpoint without it or --model-impl transformers"
    )


class RotaryEmbedding(nn.Module):
    """One cos/sin table per model. Once per step, `rotary(positions, dtype)` gives the step's Rotation,
    which every layer applies to its query and key."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_parameters(head_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        # [max_positions, head_dim]: cos | sin, the layout the Triton rotary kernel reads too
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)
        self.make_rotation: Callable[..., Rotation] = TableRotation

    def use_kernel(self, kernel: RotaryKernel) -> None:
        """Rotate with `kernel` from now on (the attention backend's fused kernel, bound once)."""
        self.make_rotation = functools.partial(KernelRotation, kernel)

    def use_native_rotate(self, rotate: NativeRotate) -> None:
        """Keep the per-step table, and rotate each layer's heads with `rotate` where it takes them (the CPU
        backend's native call)."""
        self.make_rotation = functools.partial(TableRotation, native_rotate=rotate)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:  # positions [T] int64
        return self.make_rotation(self.cos_sin_cache, positions, dtype)


class TableRotation:
    """torch: the step's cos/sin gathered once, in the model dtype like transformers; each layer rotates with them."""

    def __init__(self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 native_rotate: NativeRotate | None = None) -> None:
        cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :].to(dtype)  # [T, 1, head_dim]
        self.cos, self.sin = cos_sin.chunk(2, dim=-1)  # [T, 1, head_dim // 2] each
        self.native_rotate = native_rotate

    def __call__(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = _heads_side_by_side(query, key)
        if both is None:
            return self._rotated(query), self._rotated(key)
        rotated = self._rotated(both)  # [T, H + Hkv, head_dim]: one pass over both
        return rotated[:, :query.shape[1]], rotated[:, query.shape[1]:]

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, head_dim]
        rotated = None if self.native_rotate is None else self.native_rotate(x, self.cos, self.sin)
        return _rotate(x, self.cos, self.sin) if rotated is None else rotated


def _heads_side_by_side(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """A [T, H + Hkv, head_dim] view of query's and key's heads when key's heads follow query's in
    memory, row by row (q and k split from one fused projection), else None."""
    tokens, num_heads, head_dim = query.shape
    if (key.dtype != query.dtype or key.shape[0] != tokens or key.shape[2] != head_dim
            or query.stride() != key.stride() or query.stride()[1:] != (head_dim, 1)
            or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()
            or key.data_ptr() != query.data_ptr() + num_heads * head_dim * query.element_size()):
        return None
    return query.as_strided((tokens, num_heads + key.shape[1], head_dim), query.stride())


class KernelRotation:
    """A fused kernel gathers cos/sin from the table and rotates query and key, in one launch per layer."""

    def __init__(self, kernel: RotaryKernel, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> None:  # dtype: the kernel writes query's own
        self.kernel, self.cos_sin_cache, self.positions = kernel, cos_sin_cache, positions

    def __call__(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel(self.positions, query, key, self.cos_sin_cache)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
