"""Structured output and prompt logprobs on a CUDA device (experiments/gpu_followup.sh runs this on a lent GPU): the
bitmask is unpacked on the device, prompt-logprob tables come back to the host, and both equal the CPU
engine's."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}}}


def test_constraints_and_prompt_logprobs_on_cuda_equal_cpu(model_factory):
    model_dir = model_factory("llama")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(
                  choice=["yes", "no"])),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)]
    outputs = {device: LLM(model_dir, dtype="float32", device=device, block_size=16).generate(prompts, params)
               for device in ("cpu", "cuda")}
    cpu, cuda = outputs["cpu"], outputs["cuda"]
    assert set(json.loads(cuda[0].outputs[0].text)) == {"ok", "size"}
    assert cuda[1].outputs[0].text in ("yes", "no")
    for ours, reference in zip(cuda[2].prompt_logprobs[1:], cpu[2].prompt_logprobs[1:]):
        assert list(ours)[0] == list(reference)[0]
        first = next(iter(reference))
        assert ours[first] == pytest.approx(reference[first], abs=1e-3)
