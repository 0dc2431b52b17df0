"""Compile every Triton kernel for an sm_90 GPU (H100/H200) on a machine without one.

The interpreter forgives code the GPU compiler rejects (types of loop-carried values, tl.dot shapes,
constexpr misuse), so this runs each public wrapper on CPU tensors with the kernels' launches
recorded instead of run, then compiles every recorded launch down to a cubin (ptxas ships with
triton). Run it in a process WITHOUT TRITON_INTERPRET:

    python -m tests.kernels.compile_sm90           # every dtype x model shape; exits 1 on failure
    python -m tests.kernels.compile_sm90 --quick   # bf16 GQA-7 and fp32 head_dim 96 only (the test)
"""

from __future__ import annotations

import os
import sys
import types

import torch

DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int32: "i32", torch.int64: "i64",
}


# Shared memory one program may use on every GPU we target (sm_86/sm_89 allow 99 KB per block).
MAX_SHARED_BYTES = 99 * 1024


class LaunchRecorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **constexprs)` records instead of running."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((args, kwargs))
        return record


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Triton signature strings and constexpr values for one recorded launch."""
    signature, constexprs = {}, {}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs  # args may stop early
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + DTYPE_NAMES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


def install_recorders(modules) -> list[LaunchRecorder]:
    from triton.runtime.jit import JITFunction

    recorders = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                recorder = LaunchRecorder(value)
                setattr(module, name, recorder)
                recorders.append(recorder)
    return recorders


def compile_recorded(recorders: list[LaunchRecorder], capability: int = 90) -> list[str]:
    """Compile each distinct recorded launch; returns failure messages (empty when all compile)."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability, 32)
    failures, seen = [], set()
    for recorder in recorders:
        for args, kwargs in recorder.launches:
            signature, constexprs = _signature(recorder.kernel, args, kwargs)
            key = (recorder.kernel.__name__, str(signature), str(constexprs), str(sorted(kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            source = triton.compiler.ASTSource(fn=recorder.kernel, signature=signature, constexprs=constexprs)
            label = f"{recorder.kernel.__name__} {constexprs}"
            try:
                options = {name: kwargs[name] for name in ("num_warps", "num_stages") if name in kwargs}
                compiled = triton.compile(source, target=target, options=options)
                shared = compiled.metadata.shared
                if shared > MAX_SHARED_BYTES:
                    raise ValueError(f"needs {shared} bytes of shared memory, over {MAX_SHARED_BYTES}")
                print(f"ok   {label} shared={shared}")
            except Exception as error:  # report every kernel, not just the first failure
                failures.append(f"{label}: {type(error).__name__}: {error}")
                print(f"FAIL {label}: {error}")
    return failures


# (dtype, q heads, kv heads, head_dim): Llama-8B, Qwen2-7B (group 7), MHA, head_dim 96.
FULL_CASES = [
    (dtype, *shape)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for shape in ((32, 8, 128), (28, 4, 128), (16, 16, 64), (8, 2, 96))
]
QUICK_CASES = [(torch.bfloat16, 28, 4, 128), (torch.float32, 8, 2, 96)]


def run_wrappers_on_model_shapes(kernels_api, cases) -> None:
    """Call every public wrapper on small CPU tensors shaped like the real models."""
    from pdserve.kernels import triton_decode_attention

    block_size, num_blocks = 16, 8
    for dtype, num_heads, num_kv_heads, head_dim in cases:
        cache = torch.zeros(2, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        key_cache, value_cache = cache[0, 0], cache[0, 1]
        tokens = torch.zeros(5, num_kv_heads, head_dim, dtype=dtype)
        kernels_api.store_kv(tokens, tokens, key_cache, value_cache, torch.zeros(5, dtype=torch.int64))
        query = torch.zeros(2, num_heads, head_dim, dtype=dtype)
        tables = torch.zeros(2, num_blocks, dtype=torch.int32)
        lens = torch.ones(2, dtype=torch.int32)
        kernels_api.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.1)
        out = torch.empty_like(query)
        triton_decode_attention.launch_decode_attention(
            query, key_cache, value_cache, tables, lens, 0.1, out, partition_size=64
        )
        loc = torch.tensor([0, 2, 5], dtype=torch.int32)
        prefill_query = torch.zeros(5, num_heads, head_dim, dtype=dtype)
        kernels_api.paged_prefill_attention(prefill_query, key_cache, value_cache, tables, loc, lens, 0.1)
        packed = kernels_api.kv_pack(cache, torch.zeros(2, dtype=torch.int32), 20, 0, 2)
        kernels_api.kv_unpack(packed, cache, torch.zeros(2, dtype=torch.int64), 20, 0)
    for dtype in sorted({case[0] for case in cases}, key=str):
        hidden = torch.zeros(3, 4096, dtype=dtype)
        kernels_api.add_rms_norm(hidden, hidden, torch.ones(4096, dtype=dtype), 1e-5)
        q = torch.zeros(3, 32, 128, dtype=dtype)
        k = torch.zeros(3, 8, 128, dtype=dtype)
        cos_sin = torch.zeros(64, 128, dtype=torch.float32)
        kernels_api.rotary_embedding(torch.zeros(3, dtype=torch.int64), q, k, cos_sin)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles for the GPU instead of interpreting")
        return 2
    from pdserve.kernels import checks
    from pdserve.kernels import (
        triton_decode_attention, triton_kv_transfer, triton_norm, triton_prefill_attention,
        triton_rotary, triton_store_kv,
    )

    checks.INTERPRET = True  # let CPU tensors through the wrappers: nothing is launched
    modules = [triton_store_kv, triton_decode_attention, triton_prefill_attention, triton_kv_transfer,
               triton_norm, triton_rotary]
    recorders = install_recorders(modules)

    api = types.SimpleNamespace(
        store_kv=triton_store_kv.store_kv,
        paged_decode_attention=triton_decode_attention.paged_decode_attention,
        paged_prefill_attention=triton_prefill_attention.paged_prefill_attention,
        kv_pack=triton_kv_transfer.kv_pack,
        kv_unpack=triton_kv_transfer.kv_unpack,
        add_rms_norm=triton_norm.add_rms_norm,
        rotary_embedding=triton_rotary.rotary_embedding,
    )
    run_wrappers_on_model_shapes(api, QUICK_CASES if "--quick" in sys.argv else FULL_CASES)
    failures = compile_recorded(recorders)
    print(f"{len(failures)} kernel(s) failed to compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
