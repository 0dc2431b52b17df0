"""Check each Triton kernel against its torch reference on a GPU and time both.

    python experiments/gpu_kernels.py              # CUDA: checks, timings, decode bandwidth vs copy and SDPA
    python experiments/gpu_kernels.py --sweep      # also try decode tilings (block_n x partition x warps)
    python experiments/gpu_kernels.py --cpu-smoke  # no GPU: same code at tiny sizes, Triton interpreter

The headline figure is paged decode attention at batch 64 x 4096 context with Llama-8B shapes
(32 query heads, 8 kv heads, head_dim 128, bf16, block size 16): bytes of K/V read per second, as a
percentage of the bandwidth of a plain device copy (target >= 70%), next to torch SDPA on the same
K/V laid out contiguously. Times are medians from triton.testing.do_bench (wall clock on CPU).
Exit status: 1 if any kernel disagrees with its reference, else 0 (also without CUDA).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

TARGET_FRACTION_OF_COPY = 0.70
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}  # atol = rtol


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: `gpu` for the real run, `smoke` for the interpreter."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batch: int
    decode_context: int
    prefill_seqs: int
    prefill_prefix: int
    prefill_new: int
    num_layers: int
    transfer_tokens: int
    hidden_size: int
    copy_bytes: int


GPU_SIZES = Sizes(32, 8, 128, 16, 64, 4096, 4, 1024, 1024, 32, 2048, 4096, 1 << 30)
SMOKE_SIZES = Sizes(4, 2, 64, 16, 3, 100, 2, 17, 9, 2, 40, 64, 1 << 20)


@dataclass
class Row:
    kernel: str
    shape: str
    max_error: float
    ok: bool
    triton_ms: float
    torch_ms: float
    bytes_moved: int
    note: str = ""


# ----------------------------------------------------------------------------- timing


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn(): triton.testing.do_bench on CUDA, wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def wall_clock(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return wall_clock


def copy_bandwidth(device: torch.device, num_bytes: int, timer) -> float:
    """Bytes per second of a device-to-device tensor copy (each byte read once and written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


def max_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    """(largest absolute difference, within atol + rtol * |expected| everywhere and no NaN)."""
    tol = TOLERANCES[dtype]
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs()
    error = float(diff.max()) if diff.numel() else 0.0
    ok = bool(torch.isfinite(actual).all()) and bool((diff <= tol + tol * expected.abs()).all())
    return error, ok


# ----------------------------------------------------------------------------- data


def random_block_tables(num_seqs: int, blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    """[num_seqs, blocks_per_seq] int32: every block used once, in shuffled order."""
    pool = torch.randperm(num_seqs * blocks_per_seq, device="cpu")
    return pool.view(num_seqs, blocks_per_seq).to(torch.int32).to(device)


def random_cache(num_blocks: int, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shape = (num_blocks, sizes.block_size, sizes.num_kv_heads, sizes.head_dim)
    return torch.randn(shape, dtype=dtype, device=device)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ----------------------------------------------------------------------------- cases


def bench_store_kv(sizes, dtype, device, timer, kernels) -> Row:
    reference, triton_kernel = kernels["store_kv"]
    num_tokens = sizes.prefill_seqs * sizes.prefill_new
    num_blocks = cdiv(num_tokens, sizes.block_size) + 2
    key = torch.randn(num_tokens, sizes.num_kv_heads, sizes.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * sizes.block_size, device="cpu")[:num_tokens].to(device)
    slots[::7] = -1  # padded tokens are skipped
    caches = [random_cache(num_blocks, sizes, dtype, device) for _ in range(2)]
    expected = [c.clone() for c in caches]
    triton_kernel(key, value, caches[0], caches[1], slots)
    reference(key, value, expected[0], expected[1], slots)
    error, ok = max_error(torch.stack(caches), torch.stack(expected), dtype)
    return Row(
        "store_kv", f"T={num_tokens} H={sizes.num_kv_heads} D={sizes.head_dim}", error, ok,
        timer(lambda: triton_kernel(key, value, caches[0], caches[1], slots)),
        timer(lambda: reference(key, value, expected[0], expected[1], slots)),
        bytes_moved=4 * key.numel() * key.element_size(),
    )


def decode_inputs(sizes, batch, context, dtype, device):
    blocks_per_seq = cdiv(context, sizes.block_size)
    key_cache = random_cache(batch * blocks_per_seq, sizes, dtype, device)
    value_cache = random_cache(batch * blocks_per_seq, sizes, dtype, device)
    query = torch.randn(batch, sizes.num_heads, sizes.head_dim, dtype=dtype, device=device)
    tables = random_block_tables(batch, blocks_per_seq, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables, seq_lens, sizes.head_dim**-0.5


def decode_bytes(sizes, batch, context, dtype) -> int:
    kv = 2 * batch * context * sizes.num_kv_heads * sizes.head_dim
    q_and_out = 2 * batch * sizes.num_heads * sizes.head_dim
    return (kv + q_and_out) * torch.finfo(dtype).bits // 8


def bench_decode(sizes, dtype, device, timer, kernels) -> list[Row]:
    """The headline case (full batch x context) plus mixed lengths, against the reference and SDPA."""
    reference, triton_kernel = kernels["paged_decode_attention"]
    batch, context = sizes.decode_batch, sizes.decode_context
    args = decode_inputs(sizes, batch, context, dtype, device)
    out = triton_kernel(*args)
    error, ok = max_error(out, reference(*args), dtype)
    shape = (f"B={batch} ctx={context} Hq={sizes.num_heads} Hkv={sizes.num_kv_heads} D={sizes.head_dim} "
             f"blk={sizes.block_size}")
    rows = [Row("paged_decode_attention", shape, error, ok, timer(lambda: triton_kernel(*args)),
                timer(lambda: reference(*args)), decode_bytes(sizes, batch, context, dtype))]
    rows.append(bench_sdpa(args, out, sizes, dtype, timer))

    # Mixed lengths (1 .. context) in one batch: exercises split-K partitions left unused.
    query, key_cache, value_cache, tables, _, scale = args
    mixed = torch.randint(1, context + 1, (batch,), device="cpu").to(torch.int32).to(device)
    mixed_args = (query, key_cache, value_cache, tables, mixed, scale)
    error, ok = max_error(triton_kernel(*mixed_args), reference(*mixed_args), dtype)
    rows.append(Row("paged_decode_attention", f"B={batch} ctx=1..{context} (mixed)", error, ok,
                    timer(lambda: triton_kernel(*mixed_args)), timer(lambda: reference(*mixed_args)),
                    decode_bytes(sizes, batch, int(mixed.sum()) // batch, dtype)))
    return rows


def bench_sdpa(args, triton_out, sizes, dtype, timer) -> Row:
    """torch SDPA on the same K/V copied into contiguous [batch, kv_heads, context, head_dim]."""
    import torch.nn.functional as F

    query, key_cache, value_cache, tables, seq_lens, scale = args
    batch, context = query.shape[0], int(seq_lens[0])

    def contiguous(cache):  # [batch, kv_heads, context, head_dim]
        return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    keys, values = contiguous(key_cache), contiguous(value_cache)
    q = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    note = "enable_gqa"
    try:
        def sdpa():
            return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
        out = sdpa()
    except (TypeError, RuntimeError):
        group = sizes.num_heads // sizes.num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        note = "K/V repeated per group"

        def sdpa():
            return F.scaled_dot_product_attention(q, keys, values, scale=scale)
        out = sdpa()
    error, ok = max_error(triton_out, out.squeeze(2), dtype)  # same data: our output vs SDPA's
    return Row("torch SDPA (contiguous)", f"B={batch} ctx={context}", error, ok, float("nan"), timer(sdpa),
               decode_bytes(sizes, batch, context, dtype), note)


def bench_prefill(sizes, dtype, device, timer, kernels) -> Row:
    reference, triton_kernel = kernels["paged_prefill_attention"]
    num_seqs, prefix, new = sizes.prefill_seqs, sizes.prefill_prefix, sizes.prefill_new
    context = prefix + new
    blocks_per_seq = cdiv(context, sizes.block_size)
    key_cache = random_cache(num_seqs * blocks_per_seq, sizes, dtype, device)
    value_cache = random_cache(num_seqs * blocks_per_seq, sizes, dtype, device)
    query = torch.randn(num_seqs * new, sizes.num_heads, sizes.head_dim, dtype=dtype, device=device)
    loc = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device=device)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    tables = random_block_tables(num_seqs, blocks_per_seq, device)
    args = (query, key_cache, value_cache, tables, loc, seq_lens, sizes.head_dim**-0.5)
    error, ok = max_error(triton_kernel(*args), reference(*args), dtype)
    kv_bytes = 2 * num_seqs * context * sizes.num_kv_heads * sizes.head_dim * query.element_size()
    return Row("paged_prefill_attention", f"S={num_seqs} prefix={prefix} new={new}", error, ok,
               timer(lambda: triton_kernel(*args)), timer(lambda: reference(*args)),
               kv_bytes + 2 * query.numel() * query.element_size())


def bench_kv_transfer(sizes, dtype, device, timer, kernels) -> list[Row]:
    pack_ref, pack = kernels["kv_pack"]
    unpack_ref, unpack = kernels["kv_unpack"]
    num_tokens = sizes.transfer_tokens
    num_blocks = cdiv(num_tokens, sizes.block_size)
    shape = (sizes.num_layers, 2, 2 * num_blocks, sizes.block_size, sizes.num_kv_heads, sizes.head_dim)
    kv_cache = torch.randn(shape, dtype=dtype, device=device)
    block_ids = torch.randperm(2 * num_blocks, device="cpu")[:num_blocks].to(torch.int32).to(device)
    packed = pack(kv_cache, block_ids, num_tokens)
    error, ok = max_error(packed, pack_ref(kv_cache, block_ids, num_tokens), dtype)
    moved = 2 * packed.numel() * packed.element_size()
    label = f"L={sizes.num_layers} T={num_tokens} H={sizes.num_kv_heads} D={sizes.head_dim}"
    rows = [Row("kv_pack", label, error, ok, timer(lambda: pack(kv_cache, block_ids, num_tokens)),
                timer(lambda: pack_ref(kv_cache, block_ids, num_tokens)), moved)]
    got, expected = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
    unpack(packed, got, block_ids, num_tokens)
    unpack_ref(packed, expected, block_ids, num_tokens)
    error, ok = max_error(got, expected, dtype)
    rows.append(Row("kv_unpack", label, error, ok, timer(lambda: unpack(packed, got, block_ids, num_tokens)),
                    timer(lambda: unpack_ref(packed, expected, block_ids, num_tokens)), moved))
    return rows


def bench_norm_and_rotary(sizes, dtype, device, timer, kernels) -> list[Row]:
    norm_ref, norm = kernels["add_rms_norm"]
    rope_ref, rope = kernels["rotary_embedding"]
    num_tokens = sizes.prefill_seqs * sizes.prefill_new
    hidden = torch.randn(num_tokens, sizes.hidden_size, dtype=dtype, device=device)
    residual, weight = torch.randn_like(hidden), torch.randn(sizes.hidden_size, dtype=dtype, device=device)
    error, ok = max_error(torch.stack(norm(hidden, residual, weight, 1e-5)),
                          torch.stack(norm_ref(hidden, residual, weight, 1e-5)), dtype)
    rows = [Row("add_rms_norm", f"T={num_tokens} hidden={sizes.hidden_size}", error, ok,
                timer(lambda: norm(hidden, residual, weight, 1e-5)),
                timer(lambda: norm_ref(hidden, residual, weight, 1e-5)),
                4 * hidden.numel() * hidden.element_size())]
    query = torch.randn(num_tokens, sizes.num_heads, sizes.head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, sizes.num_kv_heads, sizes.head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (num_tokens,), device="cpu").to(device)
    inv_freq = torch.rand(sizes.head_dim // 2, device=device)
    angles = torch.arange(4096, device=device)[:, None] * inv_freq[None, :]  # [4096, head_dim // 2]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    got, expected = rope(positions, query, key, cos_sin), rope_ref(positions, query, key, cos_sin)
    error, ok = max_error(torch.cat([got[0].flatten(), got[1].flatten()]),
                          torch.cat([expected[0].flatten(), expected[1].flatten()]), dtype)
    rope_shape = f"T={num_tokens} Hq={sizes.num_heads} Hkv={sizes.num_kv_heads}"
    rows.append(Row("rotary_embedding", rope_shape, error, ok,
                    timer(lambda: rope(positions, query, key, cos_sin)),
                    timer(lambda: rope_ref(positions, query, key, cos_sin)),
                    2 * (query.numel() + key.numel()) * query.element_size()))
    return rows


def sweep_decode(sizes, dtype, device, timer, configs) -> list[str]:
    """Time decode attention under other tilings; returns report lines, fastest first."""
    from pdserve.kernels.triton_decode_attention import launch_decode_attention

    args = decode_inputs(sizes, sizes.decode_batch, sizes.decode_context, dtype, device)
    out = torch.empty_like(args[0])
    moved = decode_bytes(sizes, sizes.decode_batch, sizes.decode_context, dtype)
    results = []
    for block_n, partition, warps in configs:
        if partition % block_n:
            continue

        def run(block_n=block_n, partition=partition, warps=warps):
            launch_decode_attention(*args, out, partition_size=partition, block_n=block_n, num_warps=warps)

        try:
            ms = timer(run)
        except Exception as error:  # a tiling the GPU cannot hold: report it, keep sweeping
            results.append((float("inf"), f"block_n={block_n} partition={partition} warps={warps}: {error}"))
            continue
        results.append((ms, f"block_n={block_n:4d} partition={partition:5d} warps={warps}: "
                            f"{ms:8.3f} ms  {moved / (ms * 1e-3) / 1e9:8.1f} GB/s"))
    return [line for _, line in sorted(results, key=lambda item: item[0])]


# ----------------------------------------------------------------------------- report


def load_kernels() -> dict[str, tuple[Callable, Callable]]:
    """name -> (torch reference, Triton kernel), imported only now (after TRITON_INTERPRET is set)."""
    from pdserve.kernels.dispatch import KERNELS, triton_kernel

    return {name: (reference, triton_kernel(name)) for name, (reference, _) in KERNELS.items()}


def format_table(rows: list[Row]) -> str:
    header = (f"{'kernel':<26} {'shape':<52} {'max err':>9} {'ok':>4} {'triton ms':>10} {'torch ms':>10} "
              f"{'speedup':>8} {'GB/s':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        torch_only = math.isnan(row.triton_ms)  # the SDPA comparison row
        best = row.torch_ms if torch_only else row.triton_ms
        speedup = float("nan") if torch_only or row.triton_ms <= 0 else row.torch_ms / row.triton_ms
        gbps = row.bytes_moved / (best * 1e-3) / 1e9 if best > 0 else float("nan")
        lines.append(
            f"{row.kernel:<26} {row.shape:<52} {row.max_error:>9.2e} {'yes' if row.ok else 'NO':>4} "
            f"{row.triton_ms:>10.3f} {row.torch_ms:>10.3f} {speedup:>8.2f} {gbps:>8.1f}  {row.note}"
        )
    return "\n".join(lines)


def headline(rows: list[Row], copy_bytes_per_s: float, judge: bool = True) -> list[str]:
    """The decode kernel's bandwidth against a device copy; judged against the target only when the
    timings mean something (not in a CPU smoke run)."""
    decode, sdpa = rows[0], rows[1]
    decode_bw = decode.bytes_moved / (decode.triton_ms * 1e-3)
    sdpa_bw = sdpa.bytes_moved / (sdpa.torch_ms * 1e-3)
    fraction = decode_bw / copy_bytes_per_s
    verdict = "met" if fraction >= TARGET_FRACTION_OF_COPY else "NOT met"
    target = (f" (target >= {100 * TARGET_FRACTION_OF_COPY:.0f}%: {verdict})" if judge
              else " (smoke run: not judged against the target)")
    return [
        f"device copy bandwidth:        {copy_bytes_per_s / 1e9:9.1f} GB/s",
        f"paged decode attention:       {decode_bw / 1e9:9.1f} GB/s = {100 * fraction:5.1f}% of copy{target}",
        f"torch SDPA, contiguous K/V:   {sdpa_bw / 1e9:9.1f} GB/s = "
        f"{100 * sdpa_bw / copy_bytes_per_s:5.1f}% of copy",
    ]


def run(device: torch.device, sizes: Sizes, dtype: torch.dtype, sweep: bool) -> int:
    torch.manual_seed(0)
    timer = make_timer(device)
    kernels = load_kernels()
    rows = bench_decode(sizes, dtype, device, timer, kernels)
    rows.append(bench_store_kv(sizes, dtype, device, timer, kernels))
    rows.append(bench_prefill(sizes, dtype, device, timer, kernels))
    rows.extend(bench_kv_transfer(sizes, dtype, device, timer, kernels))
    rows.extend(bench_norm_and_rotary(sizes, dtype, device, timer, kernels))
    copy_bytes_per_s = copy_bandwidth(device, sizes.copy_bytes, timer)

    print(format_table(rows))
    print()
    print("\n".join(headline(rows, copy_bytes_per_s, judge=device.type == "cuda")))
    if sweep:
        configs = [(n, p, w) for n in (32, 64, 128) for p in (256, 512, 1024, 8192) for w in (4, 8)]
        if device.type != "cuda":
            configs = [(16, 32, 4), (16, 64, 4)]
        print("\ndecode tilings, fastest first:")
        print("\n".join(sweep_decode(sizes, dtype, device, timer, configs)))
    failed = [row.kernel for row in rows if not row.ok]
    if failed:
        print(f"\nMISMATCH against the reference: {', '.join(failed)}")
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python experiments/gpu_kernels.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the whole script at tiny sizes on CPU under the Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="also time decode attention under other tilings")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
        print("CPU smoke run under the Triton interpreter: timings are not meaningful\n")
        return run(torch.device("cpu"), SMOKE_SIZES, dtype, args.sweep)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark. Run on a GPU machine, or pass --cpu-smoke to check "
              "the kernels on CPU under the Triton interpreter.")
        return 0
    device = torch.device("cuda")
    import triton

    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.dtype}\n")
    return run(device, GPU_SIZES, dtype, args.sweep)


if __name__ == "__main__":
    sys.exit(main())
