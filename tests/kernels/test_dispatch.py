"""kernels.* picks Triton or torch per device, PDSERVE_KERNELS overrides, triton is imported lazily."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import dispatch, reference, reference_extra
from tests.kernels.subprocess_env import run_ok, run_python

EXPORTED = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "kv_pack", "kv_unpack",
            "add_rms_norm", "rotary_embedding"]


def test_default_cpu_process_uses_reference_functions_and_never_imports_triton():
    # A torch built without CUDA exports the reference functions themselves; a CUDA build exports
    # per-call wrappers around them (Triton for CUDA tensors), which must not import triton either.
    out = run_ok(
        "import sys, torch\nfrom pdserve import kernels\n"
        "from pdserve.kernels import reference, reference_extra\n"
        "cuda_built = torch.backends.cuda.is_built() or torch.version.hip is not None\n"
        f"for name in {EXPORTED!r}:\n"
        "    source = reference_extra if name in ('add_rms_norm', 'rotary_embedding') else reference\n"
        "    exported = getattr(kernels, name)\n"
        "    if cuda_built:\n"
        "        exported = exported.__wrapped__\n"
        "    assert exported is getattr(source, name), name\n"
        "kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)\n"
        "kernels.store_kv(torch.ones(3, 1, 8), torch.ones(3, 1, 8), kc, vc, torch.tensor([0, 1, 5]))\n"
        "assert kc.sum() == 24, kc.sum()\n"
        "print(kernels.kernel_backend('cpu'), kernels.kernel_backend('cuda:0'), 'triton' in sys.modules)\n"
    )
    assert out.split() == ["torch", "triton", "False"]


def test_forced_torch_backend_everywhere():
    out = run_ok("from pdserve import kernels; print(kernels.kernel_backend('cuda'), kernels.kernel_backend('cpu'))",
                 PDSERVE_KERNELS="torch")
    assert out.split() == ["torch", "torch"]


def test_forced_triton_runs_triton_on_cpu_under_the_interpreter():
    out = run_ok(
        "import sys, torch\nfrom pdserve import kernels\n"
        "from pdserve.kernels import reference\n"
        "torch.manual_seed(0)\n"
        "kc, vc = torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)\n"
        "q = torch.randn(2, 2, 64)\n"
        "bt = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)\n"
        "lens = torch.tensor([20, 5], dtype=torch.int32)\n"
        "got = kernels.paged_decode_attention(q, kc, vc, bt, lens, scale=0.125)\n"
        "want = reference.paged_decode_attention(q, kc, vc, bt, lens, 0.125)\n"
        "torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)\n"
        "print(kernels.kernel_backend('cpu'), 'pdserve.kernels.triton_decode_attention' in sys.modules)\n",
        PDSERVE_KERNELS="triton", TRITON_INTERPRET="1",
    )
    assert out.split() == ["triton", "True"]


def test_forced_triton_without_interpreter_explains_the_fix():
    result = run_python(
        "import torch\nfrom pdserve import kernels\n"
        "kernels.kv_pack(torch.randn(1, 2, 2, 16, 1, 8), torch.tensor([0]), 3)\n",
        PDSERVE_KERNELS="triton",
    )
    assert result.returncode != 0
    assert "need CUDA tensors" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


def test_unknown_backend_fails_at_import_with_the_choices():
    result = run_python("from pdserve import kernels", PDSERVE_KERNELS="cuda")
    assert result.returncode != 0
    assert "PDSERVE_KERNELS='cuda' is not a kernel backend: set it to 'torch' or 'triton'" in result.stderr


@pytest.mark.parametrize("value,expected", [("", None), ("auto", None), ("TORCH", "torch"), (" triton ", "triton")])
def test_read_forced_backend(value, expected):
    assert dispatch.read_forced_backend({"PDSERVE_KERNELS": value}) == expected
    assert dispatch.read_forced_backend({}) is None


def test_by_device_wrapper_sends_cpu_tensors_to_the_reference_by_position_or_keyword():
    calls = []

    def fake_reference(kv_cache, block_ids, num_tokens, layer_start=0, layer_end=None):
        calls.append(num_tokens)
        return reference.kv_pack(kv_cache, block_ids, num_tokens, layer_start, layer_end)

    dispatch.KERNELS["_fake"] = (fake_reference, "pdserve.kernels.does_not_exist")
    try:
        wrapper = dispatch._by_device("_fake", fake_reference)
        kv_cache = torch.randn(2, 2, 3, 4, 1, 8)
        blocks = torch.tensor([2, 0])
        positional = wrapper(kv_cache, blocks, 6)
        by_keyword = wrapper(block_ids=blocks, kv_cache=kv_cache, num_tokens=6)
    finally:
        del dispatch.KERNELS["_fake"]
    assert calls == [6, 6]
    assert torch.equal(positional, by_keyword)
    assert wrapper.__name__ == "fake_reference"  # functools.wraps keeps names for logs and tracebacks


def test_triton_kernel_lookup_returns_the_module_function():
    from pdserve.kernels import triton_store_kv

    assert dispatch.triton_kernel("store_kv") is triton_store_kv.store_kv
    assert reference_extra.add_rms_norm is dispatch.KERNELS["add_rms_norm"][0]


def test_kernel_for_chooses_once_by_device():
    from pdserve.kernels import reference

    assert dispatch.kernel_for("store_kv", "cpu") is reference.store_kv  # no wrapper left to dispatch per call
    assert dispatch.kernel_for("kv_unpack", "cuda:0") is dispatch.triton_kernel("kv_unpack")
