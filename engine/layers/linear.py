"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Fused projections (QKV, gate/up) hold one weight; each checkpoint shard is copied into its rows
through `weight_loader(param, tensor, shard_id)`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.kernels import cpu_gemm, cpu_gemm_f32

logger = logging.getLogger(__name__)

# On CPU, bfloat16 linears run on pdserve's own kernel (kernels/cpu_gemm_bf16.c) where the CPU has AVX512-BF16,
# with the weight packed once into its panels: a step's linears ran 1.1-2.1x as fast as on oneDNN's prepacked
# products at 1-32 rows (docs/results.md, CPU kernels). Other linears run on oneDNN with their weight reordered
# once into oneDNN's blocked layout (pack_linear_weights). torch's F.linear hands fp32 products to MKL, which
# repacks the whole weight on every call: on the 2-core benchmark box the prepacked products of this model's
# shapes ran 1.7-1.9x faster at 1-32 rows and 1.45x faster at 2048 rows (docs/results.md, offline throughput).
# On CPUs without AVX-512, float32 linears run on pdserve's AVX2 kernel (kernels/cpu_gemm_f32.c) instead: a decode
# step's linears ran 1.4-1.7x as fast as on oneDNN, a prompt's about 0.9x (docs/results.md, CPU kernels).
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# A float32 weight smaller than this stays on F.linear: at 1-128 rows its product ran 1.1-6x faster there than
# packed (one call's fixed cost dominates), and at 512-2048 rows packed was at most 12% faster
# (docs/design/attention-features.md, MoE throughput). bf16 weights of every size run packed (as fast or faster).
MIN_PACKED_FP32_ELEMENTS = 65_536
EXACT_ROWS = 16  # decode batches: run as they are (one row runs another kernel, whose results differ)
ROW_BUCKETS_PER_OCTAVE = 8


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not match the model's parameter."""


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(
            f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, the model expects {tuple(target.shape)}: "
            "the weights do not belong to this config.json"
        )
    with torch.no_grad():
        target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, name: str = "") -> None:
    copy_checked(param.data, loaded, name)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = default_weight_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader
        self.packed_weight: torch.Tensor | None = None  # oneDNN layout, set by pack_linear_weights
        self.native_weight: torch.Tensor | None = None  # pdserve's kernel's panels (its dtype), by pack_linear_weights

    def pack_for_cpu(self, keep_weight: bool) -> bool:
        """Pack the weight for pdserve's kernel of its dtype (bf16, or float32 where the CPU lacks AVX-512), else
        reorder it for oneDNN; without keep_weight the plain copy is released. False if the weight stays on
        F.linear (not on CPU, a dtype oneDNN lacks, a CPU without its instructions, or a small float32 weight on
        oneDNN: MIN_PACKED_FP32_ELEMENTS)."""
        return _pack(self, keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed_weight is not None or self.native_weight is not None:
            return _packed_linear(self, x)
        return F.linear(x, self.weight, self.bias)


def _pack(linear: nn.Module, keep_weight: bool) -> bool:
    """Set linear.native_weight (pdserve's panels) or linear.packed_weight (oneDNN layout) from linear.weight;
    see Linear.pack_for_cpu."""
    weight = linear.weight
    linear.native_weight = linear.packed_weight = None
    if weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES:
        return False
    if cpu_gemm.supports(weight, linear.bias):
        linear.native_weight = cpu_gemm.pack_weight(weight.data)
    elif cpu_gemm_f32.supports(weight, linear.bias):
        linear.native_weight = cpu_gemm_f32.pack_weight(weight.data)
    elif not torch.backends.mkldnn.is_available() or (
            weight.dtype == torch.float32 and weight.numel() < MIN_PACKED_FP32_ELEMENTS):
        return False
    else:
        try:
            linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.data)  # [out, in] blocked
        except RuntimeError as exc:  # e.g. bf16 on a CPU without avx512_bf16/AMX
            logger.debug("linear weight %s stays on F.linear: %s", tuple(weight.shape), exc)
            return False
    if not keep_weight:
        linear.weight = None
    return True


def _packed_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
    if linear.native_weight is not None:
        kernel = cpu_gemm if linear.native_weight.dtype == torch.bfloat16 else cpu_gemm_f32
        return kernel.linear(x, linear.native_weight, linear.out_features, linear.bias)
    rows = x.numel() // x.shape[-1]
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight, linear.bias, "none", [], "")
    flat = _row_buffer(padded, x)  # [padded, in]: x's rows, then zero rows
    with one_cpu_thread(x.device):  # memory-bound copies: see engine.cpu_threads
        flat[:rows].copy_(x.reshape(rows, x.shape[-1]))
        flat[rows:].zero_()
    out = torch.ops.mkldnn._linear_pointwise(flat, linear.packed_weight, linear.bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


_ROW_BUFFERS: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (in_features, dtype) -> [rows, in], reused


def _row_buffer(rows: int, x: torch.Tensor) -> torch.Tensor:  # [rows, in] of x's dtype, contents undefined
    """A padded input's memory, kept for the next call: a fresh one per call cost more (page faults) than the
    linear's own padding rows."""
    key = (x.shape[-1], x.dtype)
    buffer = _ROW_BUFFERS.get(key)
    # one made under inference_mode (an engine's step) cannot be written outside it (a caller's own forward)
    stale = buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
    if buffer is None or stale or buffer.shape[0] < rows:
        buffer = _ROW_BUFFERS[key] = x.new_empty(rows, x.shape[-1])
    return buffer[:rows]


def padded_rows(rows: int) -> int:
    """The row count a packed linear runs with: `rows` up to EXACT_ROWS, above that rounded up to one of
    ROW_BUCKETS_PER_OCTAVE sizes per power of two (at most 1/ROW_BUCKETS_PER_OCTAVE more rows). oneDNN keeps
    one primitive per input shape; a row count per step that is always new (prefill) made a new one per
    linear per step, and those caches kept growing the heap (docs/results.md, the prefill engine's memory)."""
    if rows <= EXACT_ROWS:
        return rows
    granule = (1 << (rows.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE
    return -(-rows // granule) * granule


def warm_packed_linears(linears: Iterable[nn.Module], max_rows: int) -> int:
    """Run one packed linear of each weight shape once at every row count it can see (padded_rows of 1..max_rows);
    returns the number of calls. oneDNN makes a primitive for each input shape on first use and keeps it: warmed,
    an engine holds the whole set from the start instead of growing towards it while it serves (docs/results.md,
    the prefill engine's memory)."""
    by_shape = {}
    for linear in linears:
        if isinstance(linear, Linear) and linear.packed_weight is not None:
            by_shape.setdefault((*linear.packed_weight.shape, linear.packed_weight.dtype, linear.bias is None), linear)
    row_counts = sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})
    started = time.monotonic()
    with torch.inference_mode():
        for (_, in_features, dtype, _), linear in by_shape.items():
            for rows in row_counts:
                linear(torch.zeros(rows, in_features, dtype=dtype))  # [rows, in] -> [rows, out]
    logger.info("warmed %d linear shapes at %d row counts in %.1fs", len(by_shape), len(row_counts),
                time.monotonic() - started)
    return len(by_shape) * len(row_counts)


class MergedLinear(Linear):
    """Several projections of the same input stacked by output rows, e.g. q|k|v or gate|up.

    shard_sizes maps each shard id ("q", "k", "v" or 0, 1) to its number of output rows, in order.
    """

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object, name: str = "") -> None:
        offset, size = self.shard_offsets[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded, name)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        # [T, sum(sizes)] -> one [T, size] view per shard, in declaration order
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every CPU Linear's weight once, after loading (pdserve's bf16 kernel, else oneDNN); returns how
    many were packed, and logs which kernel runs them.

    A weight that another module also uses (an lm_head tied to the embedding) is kept; the others are
    released, so packing does not double the model's memory.
    """
    shared = _shared_parameter_ids(model, Linear)
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    any_bf16 = any(linear.weight.dtype == torch.bfloat16 for linear in linears)
    packed = sum(linear.pack_for_cpu(keep_weight=id(linear.weight) in shared) for linear in linears)
    _log_linear_kernels(linears, any_bf16)
    return packed


def _log_linear_kernels(linears: list[Linear], any_bf16: bool) -> None:
    native = sum(linear.native_weight is not None for linear in linears)
    onednn = sum(linear.packed_weight is not None for linear in linears)
    if native or onednn:
        logger.info("CPU linears: %d on pdserve's kernels, %d on oneDNN, %d on F.linear", native, onednn,
                    len(linears) - native - onednn)
    if any_bf16 and not native and cpu_gemm.unavailable_reason():
        logger.info("bf16 linears run on oneDNN: pdserve's kernel is unavailable (%s)", cpu_gemm.unavailable_reason())


def pack_torch_linears(model: nn.Module) -> int:
    """The same for the plain `nn.Linear`s of a transformers model (the transformers backend): each
    packed one gets a forward on the packed weight. transformers' code may still look at a weight's
    dtype or device, so a released weight stays a Parameter, emptied ([0] elements, same dtype)."""
    shared = _shared_parameter_ids(model, nn.Linear)
    packed = 0
    for module in model.modules():
        if type(module) is nn.Linear and _pack(module, keep_weight=True):
            module.forward = functools.partial(_packed_linear, module)  # the instance's own forward
            if id(module.weight) not in shared:
                module.weight.data = module.weight.data.new_empty(0)
            packed += 1
    return packed


def _shared_parameter_ids(model: nn.Module, linear_type: type) -> set[int]:
    """ids of parameters that modules other than linears hold (an embedding tied to the lm_head)."""
    return {id(param) for module in model.modules() if not isinstance(module, linear_type)
            for param in module.parameters(recurse=False)}
