#!/usr/bin/env bash
# Every GPU check of pdserve in one run, for a lent GPU machine (its own python3 with torch + triton;
# no network there). Writes logs to $OUT (or ./gpu-out) and never stops at the first failure.
#
#     bash experiments/gpu_session.sh          # at most 570 s of steps (each has its own limit), for one 10-minute call
#
# 1. the CUDA-only tests (CUDA graphs capture/replay, sm_90 kernel builds),
# 2. python3 experiments/gpu_kernels.py --sweep: every Triton kernel against its torch reference, timings,
#    decode-attention bandwidth as a share of device copy bandwidth (goal >= 70%),
# 3. python3 experiments/gpu_engine.py: engine throughput with and without CUDA graphs, greedy parity on cuda.
# 4. P -> D on CUDA: greedy parity with colocated (streamed and sent after), then python
#    experiments/pd_transfer.py --device cuda: transfer time against prefill time (both skipped when the
#    machine's python lacks pyzmq, msgpack, pydantic or xxhash).
# Record the printed tables in docs/results.md ("GPU (H200)").
# The lent H200 image (2026-12) has torch 2.11, triton 3.6, msgpack and xxhash but no pyzmq, pydantic or simpy:
# download their py3.12 manylinux wheels into .whl/ here (pyzmq, pydantic, pydantic_core, annotated-types,
# typing-inspection, typing_extensions, simpy; see the device tool's README), carry .whl, and run
#     pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site bash experiments/gpu_session.sh
# (engine processes keep the caller's PYTHONPATH).
source "$(dirname "$0")/gpu_common.sh"
run cuda-tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/kernels
run gpu-kernels 150 python3 experiments/gpu_kernels.py --sweep
run gpu-engine 120 python3 experiments/gpu_engine.py
if python3 -c "import zmq, msgpack, pydantic, xxhash" 2>/dev/null; then
    run pd-cuda-tests 75 python3 -m pytest -q -p no:cacheprovider tests/decode/test_disaggregated.py -k cuda
    run pd-transfer-cuda 75 python3 experiments/pd_transfer.py --device cuda --prompt-lens 1024 4096 --repeats 3
else
    echo "=== pd-transfer-cuda skipped: this python lacks pyzmq, msgpack, pydantic or xxhash" | tee "$OUT/pd-transfer-cuda.log"
fi
