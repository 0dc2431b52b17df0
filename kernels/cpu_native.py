"""pdserve's native CPU kernels, built with the host's C compiler on first use and loaded with ctypes: the paged
decode attention and the KV store (cpu_paged_decode.c, wrapped here), and the others (wrapped in kernels.cpu_gemm,
cpu_norm_rotary and cpu_prefill).

Each shared library is compiled once per source, compiler and CPU (`-O3 -march=native`; OpenMP on the
libgomp that torch has loaded, or none where the compiler has none) into $PDSERVE_CACHE/kernels (default
~/.cache/pdserve/kernels) and reused by every later process. Without a compiler, or with
PDSERVE_CPU_KERNEL=torch, `library()` returns None with the reason in `unavailable_reason()`, and the work runs
on torch ops (kernels.torch_paged for attention, oneDNN for linears). `functions()` binds a library's named
functions to their ctypes signatures once per process, for this module and the kernels built on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
ENV_VAR = "PDSERVE_CPU_KERNEL"  # "torch": never build or use a native kernel
CACHE_ENV_VAR = "PDSERVE_CACHE"  # pdserve's cache root, as for the demo model
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
OPENMP = "-fopenmp"  # dropped when the compiler refuses it (Apple's clang): one thread per call then

_lock = threading.Lock()
# per source: "library" (the ctypes.CDLL) or "reason" (why none), and once functions() has run, "functions" (the
# bound tuple, or None; "reason" then also where a library's check refused this CPU)
_state: dict[Path, dict[str, object]] = {}

_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_DECODE = {"pdserve_paged_decode": (_INT, [_POINTER, _POINTER, _POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT,
                                           _INT, _INT, _INT, _INT, _FLOAT, _FLOAT, _POINTER, _POINTER, _INT,
                                           ctypes.c_int64, _INT]),
           "pdserve_store_kv": (_INT, [_POINTER, ctypes.c_int64, _POINTER, ctypes.c_int64, _POINTER, _POINTER, _POINTER,
                                       _INT, ctypes.c_int64, ctypes.c_int64])}


def library(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The loaded library built from `source`, or None (see unavailable_reason)."""
    state = _state.get(source)
    if state is None:
        with _lock:
            state = _state.get(source) or _state.setdefault(source, _load(source))
    return state.get("library")  # type: ignore[return-value]


def unavailable_reason(source: Path = SOURCE) -> str | None:
    library(source)
    return _state[source].get("reason")  # type: ignore[return-value]


def functions(source: Path, signatures: dict[str, tuple], requires: tuple[str, str] | None = None) -> tuple | None:
    """The functions named in `signatures` (name -> (restype, argtypes)), in its order, from the library built from
    `source`; None without the library, or where `requires` = (a check function, the reason) and the check returns
    0 on this CPU (unavailable_reason then says so). Bound once per process: later calls take no lock."""
    try:
        return _state[source]["functions"]  # type: ignore[return-value]
    except KeyError:
        pass
    with _lock:
        state = _state.get(source) or _state.setdefault(source, _load(source))
        if "functions" not in state:
            state["functions"] = _bind(state, signatures, requires)
    return state["functions"]  # type: ignore[return-value]


def decode_kernel():
    """The loaded `pdserve_paged_decode` function, or None (see unavailable_reason)."""
    bound = functions(SOURCE, _DECODE)
    return None if bound is None else bound[0]


def _bind(state: dict[str, object], signatures: dict[str, tuple], requires: tuple[str, str] | None) -> tuple | None:
    loaded = state.get("library")
    if loaded is not None and requires is not None and not getattr(loaded, requires[0])():
        loaded, state["reason"] = None, requires[1]
    if loaded is None:
        return None
    bound = tuple(getattr(loaded, name) for name in signatures)
    for function, (restype, argtypes) in zip(bound, signatures.values()):
        function.restype, function.argtypes = restype, argtypes
    return bound


def _load(source: Path) -> dict[str, object]:
    if os.environ.get(ENV_VAR, "").lower() == "torch":
        return {"reason": f"{ENV_VAR}=torch"}
    compiler_path = compiler()
    if compiler_path is None:
        return {"reason": "no C compiler on PATH (install gcc to build pdserve's native CPU kernels)"}
    try:
        return {"library": ctypes.CDLL(str(build(compiler_path, source)))}
    except (OSError, subprocess.SubprocessError) as error:
        return {"reason": f"building {source.name} with {compiler_path} failed: {str(error).strip()[-300:]}"}


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(compiler: str, source: Path = SOURCE) -> Path:
    """The compiled library for this source (and the headers beside it), compiler and CPU: built once into the
    cache, atomically."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]  # what a source may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, version, " ".join(FLAGS),
                                    platform.machine(), cpu_flags()]).encode()).hexdigest()[:16]
    directory = Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "pdserve") / "kernels"
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, str(source), "-o", str(built)]
        result = subprocess.run([*command, OPENMP, *_openmp_link_flags()], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr or result.stdout)
        os.replace(built, target)  # another process may have built it too: the same bytes
    return target


def cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo (else platform.processor()): part of a build's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _openmp_link_flags() -> list[str]:
    """Link against the libgomp torch ships (one OpenMP runtime and thread pool in the process)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    return [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []


def paged_decode(
    query: torch.Tensor,  # [S, num_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim] float32 or bfloat16, contiguous
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context including the new token
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [S, num_heads, head_dim], query's dtype
    kernel = decode_kernel()
    num_seqs, num_heads, head_dim = query.shape
    bf16_io = query.dtype == torch.bfloat16  # read and written as it is: no float32 copies
    if bf16_io:  # read where it is when each token's heads are contiguous (q split from a fused projection)
        q = query if heads_contiguous(query) else query.contiguous()
    else:
        q = query.float().contiguous()
    tables = int32_contiguous(block_tables)
    lens = int32_contiguous(seq_lens)
    sink_logits = None if sinks is None else sinks.float().contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    status = kernel(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_cache.dtype == torch.bfloat16,
                    tables.data_ptr(), tables.shape[1], lens.data_ptr(), num_seqs, num_heads, key_cache.shape[2],
                    head_dim, key_cache.shape[1], sliding_window or 0, scale, soft_cap or 0.0,
                    None if sink_logits is None else sink_logits.data_ptr(), out.data_ptr(), bf16_io, q.stride(0),
                    torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate its logits buffer")
    return out if out.dtype == query.dtype else out.to(query.dtype)


def int32_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """tensor as contiguous int32: itself when it already is (the backend's step tensors), without a call."""
    return tensor if tensor.dtype == torch.int32 and tensor.is_contiguous() else tensor.to(torch.int32).contiguous()


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether paged_decode takes these tensors: CPU, a float32 or bfloat16 cache, K and V of one shape."""
    return (query.device.type == "cpu" and key_cache.dtype in (torch.float32, torch.bfloat16)
            and value_cache.dtype == key_cache.dtype and key_cache.shape == value_cache.shape
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and query.shape[1] % key_cache.shape[2] == 0 and query.shape[2] == key_cache.shape[3])


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], the cache's dtype, each token's [num_kv_heads, head_dim] contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative: not stored
) -> bool:
    """Each token's K and V rows into its cache slot in one native call (two index_copy_ calls in torch); False,
    with nothing written, where the kernel or these tensors do not allow it (the caller then uses torch)."""
    bound = functions(SOURCE, _DECODE)
    if (bound is None or key.device.type != "cpu" or key.dtype != key_cache.dtype or value.dtype != key_cache.dtype
            or value_cache.dtype != key_cache.dtype or key_cache.shape != value_cache.shape
            or key.shape[1:] != key_cache.shape[2:] or value.shape != key.shape
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or not (heads_contiguous(key) and heads_contiguous(value))
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return False
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    status = bound[1](key.data_ptr(), key.stride(0) * key.element_size(), value.data_ptr(),
                      value.stride(0) * value.element_size(), key_cache.data_ptr(), value_cache.data_ptr(),
                      slot_mapping.data_ptr(), key.shape[0], key.shape[1] * key.shape[2] * key.element_size(),
                      num_slots)
    if status != 0:
        raise IndexError(f"a KV slot past the cache's {num_slots} slots: the step's slot_mapping is corrupt")
    return True


def heads_contiguous(tensor: torch.Tensor) -> bool:  # [T, H, D]: each token's [H, D] contiguous (q split from qkv)
    return tensor.dim() == 3 and tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]
