#!/usr/bin/env bash
# What the first GPU run (experiments/gpu_session.sh, 2026-12-04) left open, in one run of at most ~540 s of steps:
#
#     bash experiments/gpu_followup.sh        # logs and JSON under $OUT (or ./gpu-out)
#
# 1. tests/engine/test_attention_backends.py on CUDA (its fused norm/rotary test was fixed for CUDA tensors
#    after the first run and has not run on a GPU since);
# 2. the KV link alone, with its timing fixed (the payload made before the clock, one torch thread per pinned
#    side): python3 experiments/connector_throughput.py over tcp and ipc, with CURVE. The first profile's link
#    cost 69.5 ms per request with the sender's CPU equal to the wall time;
# 3. pdserve profile --device cuda --dtype bfloat16 (the first profile ran the engine in float32), then pdserve
#    plan on it with the first run's command, to compare with docs/results.md ("GPU (H200)").
# 4. structured output and prompt logprobs on CUDA (tests/engine/test_api_features_cuda.py), against the CPU engine.
# Set-up as gpu_session.sh (experiments/gpu_common.sh): carry .whl (pyzmq, pydantic, simpy, llguidance ... for the machine's
# python) and run
#     pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site bash experiments/gpu_followup.sh
source "$(dirname "$0")/gpu_common.sh"
run attention-backends 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py
run kv-link 150 python3 experiments/connector_throughput.py --sizes-mib 1 4 16 44 --total-mib 88 --repeats 2 --curve
run profile-bf16 180 python3 -m pdserve profile --device cuda --dtype bfloat16 --out "$OUT/profile-h200-bf16.json"
run plan-bf16 60 python3 -m pdserve plan --profile "$OUT/profile-h200-bf16.json" --engines 8 --slo ttft:300 tpot:20 \
    --find-goodput --num-prompts 1000 --input-len 1024 --output-len 128 --no-plots --output-dir "$OUT/plan-bf16"
run api-features-cuda 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_api_features_cuda.py
