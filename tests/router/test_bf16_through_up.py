"""bf16 end to end: `pdserve up --dtype bfloat16` disaggregated (1P1D) and colocated give, through the real
openai client, exactly the offline engine's bf16 greedy tokens (one request at a time, the same chunk size,
so every step runs the same shapes), and every KV block is free afterwards."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.router.conftest import layout_stack, openai_client

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Parser:\n    def __init__(self, text):",
           "for i in range(10):\n    total += i * i  # squares\n" * 3]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline_bf16(tiny_model):
    # the chunk size of tests/router/conftest.py's ENGINE_ARGS, so the prompts are prefilled in the same pieces
    return LLM(tiny_model, dtype="bfloat16", block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)


@pytest.mark.parametrize("layout", ["1p1d", "colocated"])
def test_bf16_greedy_equals_offline(layout, tiny_model, offline_bf16, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with layout_stack(layout, tiny_model, tmp_path, "--dtype", "bfloat16") as up:
        client = openai_client(up)
        for prompt in PROMPTS:
            prompt_ids = offline_bf16.tokenizer.encode(prompt)
            expected = offline_bf16.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0].token_ids
            answer = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
            got = answer.choices[0].model_extra.get("token_ids")
            assert got == list(expected), f"{layout}: {prompt!r}"
