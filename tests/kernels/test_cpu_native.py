"""The CPU's native paged decode attention against the torch plan it replaces (kernels.torch_paged), its build
cache, and its fallback when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.kernels import cpu_native, torch_paged

pytestmark = pytest.mark.skipif(cpu_native.decode_kernel() is None,
                                reason=f"no native CPU kernel: {cpu_native.unavailable_reason()}")


def paged_case(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int = 0):
    """A cache with each sequence's blocks scattered at random, and one query token per sequence."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [(length + block_size - 1) // block_size for length in lens]
    num_blocks = sum(blocks) + 3  # a few blocks that no sequence owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    owners = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lens), max(max(blocks), 1), dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = owners[taken:taken + count]
        taken += count
    query = torch.randn(len(lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


CASES = {  # lens, num_heads, num_kv_heads, head_dim, block_size
    "gqa-3": ([300, 17, 64, 1], 9, 3, 64, 16),
    "mha": ([40, 33], 4, 4, 32, 16),
    "gqa-8-d128": ([129, 250], 16, 2, 128, 32),
    "head-dim-80": ([23, 70], 6, 2, 80, 8),
    "head-dim-24": ([40, 19], 4, 2, 24, 16),  # not a multiple of 16: the portable loops, not the AVX-512 tree
    "block-of-one": ([5, 9], 4, 2, 16, 1),
    "empty-and-padding": ([0, 12, 0, 3], 4, 2, 64, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window, soft_cap, with_sinks", [(None, None, False), (16, None, False), (None, 20.0, True),
                                                           (7, 5.0, True)])
def test_native_decode_equals_the_torch_plan(case, dtype, window, soft_cap, with_sinks):
    lens, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    query, key_cache, value_cache, tables, seq_lens = paged_case(lens, num_heads, num_kv_heads, head_dim,
                                                                 block_size, dtype)
    sinks = torch.randn(num_heads) if with_sinks else None
    plan = torch_paged.plan_decode(tables, seq_lens, block_size, sliding_window=window)
    expected = torch_paged.decode_attention_planned(query, key_cache, value_cache, plan, 0.17, soft_cap, sinks)
    assert cpu_native.supports(query, key_cache, value_cache)
    got = cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.17, window, soft_cap, sinks)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the float32 result
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    for row, length in enumerate(lens):  # nothing to attend to: zeros, as the torch plan gives
        if length == 0:
            assert not got[row].any()


def test_two_threads_give_the_single_threads_result():
    # enough positions (2,675 x 2 KV heads x 64 > 2^18 elements) that the call splits over its threads
    query, key_cache, value_cache, tables, seq_lens = paged_case([2000, 5, 90, 31, 549], 8, 2, 64, 16, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (sequence, KV head) is one thread's work, in the same order


def test_other_layouts_are_left_to_the_torch_plan():
    query, key_cache, value_cache, _, _ = paged_case([4], 4, 2, 16, 16, torch.float32)
    assert not cpu_native.supports(query, key_cache.half(), value_cache.half())  # float16: torch's
    assert not cpu_native.supports(query, key_cache, value_cache[..., :8].contiguous())  # K and V differ (MLA-like)
    assert not cpu_native.supports(query, key_cache.transpose(1, 2), value_cache.transpose(1, 2))  # not contiguous


def test_the_library_is_built_once_per_source_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_native.CACHE_ENV_VAR, str(tmp_path))
    compiler = cpu_native.compiler()
    first = cpu_native.build(compiler)
    built_at = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    assert cpu_native.build(compiler) == first and first.stat().st_mtime_ns == built_at  # not rebuilt
    assert [path.name for path in (tmp_path / "kernels").iterdir()] == [first.name]  # no scratch left behind


@pytest.mark.parametrize("setting, reason", [
    ({"PDSERVE_CPU_KERNEL": "torch"}, "PDSERVE_CPU_KERNEL=torch"),
    ({"CC": "/nonexistent/cc"}, "failed"),
])
def test_without_the_kernel_decode_runs_on_torch_ops_and_says_why(monkeypatch, caplog, setting, reason):
    from pdserve.engine.attention.torch_paged import TorchPagedBackend

    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_native, "_state", {})  # as in a fresh process
    assert cpu_native.decode_kernel() is None and reason in cpu_native.unavailable_reason()
    with caplog.at_level(logging.INFO, logger="pdserve.engine.attention.torch_paged"):
        backend = TorchPagedBackend(block_size=16)
    assert not backend.native_decode
    assert f"torch ops with a gather copy ({cpu_native.unavailable_reason()})" in caplog.text


def test_a_compiler_without_openmp_still_builds_the_kernel(tmp_path, monkeypatch):
    import ctypes

    monkeypatch.setenv(cpu_native.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_native, "OPENMP", "-fno-such-openmp-flag")  # refused, as Apple's clang refuses -fopenmp
    library = ctypes.CDLL(str(cpu_native.build(cpu_native.compiler())))
    assert library.pdserve_paged_decode  # built without OpenMP: its pragmas are ignored, one thread per call


def test_a_query_bf16_cannot_hold_is_not_rounded_to_it():
    """A bf16 cache with a float32 query that bfloat16 does not hold exactly: the logits use the query as it is
    (the in-place bf16 products are only for a bf16 model's query)."""
    query, key_cache, value_cache, tables, seq_lens = paged_case([64, 48], 4, 2, 64, 16, torch.bfloat16)
    query = query.float() + 1e-3  # off the bf16 grid
    plan = torch_paged.plan_decode(tables, seq_lens, 16)
    expected = torch_paged.decode_attention_planned(query, key_cache, value_cache, plan, 0.2)
    got = cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["gqa-3", "gqa-8-d128", "head-dim-24", "empty-and-padding"])
def test_a_bf16_query_is_read_and_its_output_written_in_bf16(case):
    """bf16 in and out (no float32 copies around the call): the float32 call's result rounded to bf16, exactly."""
    lens, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    query, key_cache, value_cache, tables, seq_lens = paged_case(lens, num_heads, num_kv_heads, head_dim, block_size,
                                                                 torch.bfloat16)
    sinks = torch.randn(num_heads)
    got = cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.17, 16, 5.0, sinks)
    in_float32 = cpu_native.paged_decode(query.float(), key_cache, value_cache, tables, seq_lens, 0.17, 16, 5.0, sinks)
    assert got.dtype == torch.bfloat16 and in_float32.dtype == torch.float32
    assert torch.equal(got, in_float32.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_the_torch_store_writes(dtype):
    """Rows of a fused projection (strided tokens), padding slots (-1) skipped, every other slot untouched."""
    from pdserve.kernels import reference

    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=generator).to(dtype)
    key, value = qkv[:, 576:768].view(7, 3, 64), qkv[:, 768:].view(7, 3, 64)  # not contiguous: rows of 960
    slots = torch.tensor([5, -1, 17, 0, 63, -1, 40])
    caches = [torch.randn(4, 16, 3, 64, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    reference.store_kv(key, value, *expected, slots)
    assert cpu_native.store_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing():
    key = value = torch.randn(2, 3, 64)
    caches = [torch.zeros(4, 16, 3, 64) for _ in range(2)]
    with pytest.raises(IndexError, match="past the cache's 64 slots"):
        cpu_native.store_kv(key, value, *caches, torch.tensor([3, 64]))
    assert not caches[0].any() and not caches[1].any()


def test_store_kv_leaves_other_dtypes_and_layouts_to_torch():
    key = value = torch.randn(2, 3, 64)
    cache = torch.zeros(4, 16, 3, 64)
    slots = torch.tensor([0, 1])
    assert not cpu_native.store_kv(key.bfloat16(), value.bfloat16(), cache, cache.clone(), slots)  # dtype differs
    assert not cpu_native.store_kv(key, value, cache, cache.clone(), slots.int())  # int32 slots
    assert not cpu_native.store_kv(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, cache.clone(),
                                   slots)  # a token's heads not contiguous
    assert not cache.any()


def test_a_bf16_query_split_from_a_fused_projection_is_read_in_place():
    """q as the engine has it, a view of [T, (Hq + 2 Hkv) D] rows: the same output as its contiguous copy."""
    lens, num_heads, num_kv_heads, head_dim, block_size = CASES["gqa-3"]
    query, key_cache, value_cache, tables, seq_lens = paged_case(lens, num_heads, num_kv_heads, head_dim, block_size,
                                                                 torch.bfloat16)
    fused = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim).bfloat16()
    fused[:, :num_heads * head_dim] = query.flatten(1)
    view = fused[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    assert not view.is_contiguous()
    got = cpu_native.paged_decode(view, key_cache, value_cache, tables, seq_lens, 0.17)
    assert torch.equal(got, cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.17))
