"""experiments/gpu_kernels.py runs end to end on CPU (--cpu-smoke) and says so clearly without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.experiments import load_experiment

gpu_kernels = load_experiment("gpu_kernels")


def test_cpu_smoke_checks_every_kernel_and_prints_the_table(capsys):
    assert gpu_kernels.main(["--cpu-smoke", "--sweep"]) == 0
    printed = capsys.readouterr().out
    for name in ("paged_decode_attention", "torch SDPA (contiguous)", "store_kv", "paged_prefill_attention",
                 "kv_pack", "kv_unpack", "add_rms_norm", "rotary_embedding"):
        assert name in printed
    assert " NO " not in printed and "MISMATCH" not in printed
    assert "% of copy (smoke run: not judged against the target)" in printed
    assert "target >=" not in printed and "met" not in printed, "a smoke run does not judge"
    assert "decode tilings, fastest first:" in printed and "block_n=  16 partition=   32" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the real benchmark")
def test_without_cuda_explains_and_exits_zero(capsys):
    assert gpu_kernels.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_a_real_run_judges_the_decode_bandwidth():
    rows = [gpu_kernels.Row("paged_decode_attention", "", 0.0, True, 1.0, 2.0, 10**9),
            gpu_kernels.Row("torch SDPA (contiguous)", "", 0.0, True, float("nan"), 1.0, 10**9)]
    lines = gpu_kernels.headline(rows, copy_bytes_per_s=2e12)
    assert "(target >= 70%: NOT met)" in lines[1]
    assert "(target >= 70%: met)" in gpu_kernels.headline(rows, copy_bytes_per_s=1e12)[1]


def test_mismatch_is_reported_and_fails(capsys):
    # A kernel that disagrees with its reference must flip the exit status.
    row = gpu_kernels.Row("store_kv", "T=1", 1.0, False, 1.0, 2.0, 100)
    table = gpu_kernels.format_table([row])
    assert " NO " in table
    error, ok = gpu_kernels.max_error(torch.ones(3), torch.zeros(3), torch.float32)
    assert (error, ok) == (1.0, False)
    assert gpu_kernels.max_error(torch.tensor([float("nan")]), torch.zeros(1), torch.float32)[1] is False
