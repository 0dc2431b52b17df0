"""The thread-split experiment builds the kernel as it was at a commit and times it against today's: at HEAD the two
are the same source, so they must give the same bytes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_gemm
from tests.experiments import load_experiment

experiment = load_experiment("gemm_thread_split")


@pytest.mark.skipif(cpu_gemm.packed_gemm() is None, reason="pdserve's bf16 kernel does not run here")
def test_the_kernel_at_a_commit_builds_and_computes_what_todays_does(tmp_path):
    kernel = experiment.kernel_at("HEAD", tmp_path)
    torch.manual_seed(0)
    weight = torch.randn(100, 64, dtype=torch.bfloat16)
    calls = [(cpu_gemm.pack_weight(weight), 64, 100)]
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    out = torch.empty(40, 100, dtype=torch.bfloat16)
    kernel(x.data_ptr(), calls[0][0].data_ptr(), None, out.data_ptr(), 40, 64, 100, 2)
    assert torch.equal(out, cpu_gemm.linear(x, calls[0][0], 100))
    times = experiment.in_turns({"then": kernel, "now": cpu_gemm.packed_gemm()}, calls, 40, 2, repeats=2)
    assert set(times) == {"then", "now"} and all(seconds > 0 for seconds in times.values())


def test_a_commit_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--against no-such-commit: no kernels/cpu_gemm_bf16.c there"):
        experiment.kernel_at("no-such-commit", tmp_path)
