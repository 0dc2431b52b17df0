"""An MLA (DeepSeek-V3) latent cache crosses the KV link as it is: one plane of kv_lora_rank + rope values per
layer and token. Prefill and decode processes over real ZeroMQ: greedy fp32 output equals transformers, each
request sends exactly layers x latent x 4 bytes per token (the latent's share of what K and V would be), and
no block is left behind."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.decode.test_disaggregated import assert_no_leaks, running_pair
from tests.engine.deepseek_models import DEEPSEEK_V3_SHAPE, make_deepseek_model_dir
from tests.engine.parity import assert_greedy_match, hf_greedy

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
PROMPTS = [list(range(10, 14)), list(range(30, 41)), list(range(100, 170))]  # one block, a partial one, chunked


def test_the_latent_travels_and_output_equals_transformers(model_factory, tmp_path):
    model_dir = make_deepseek_model_dir(tmp_path / "deepseek-v3", model_factory("llama"))
    shape = DEEPSEEK_V3_SHAPE
    latent = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    token_bytes = shape["num_hidden_layers"] * latent * 4  # one plane per layer, fp32
    # what K and V of every head would take: layers x 2 x heads x (nope + rope, and v) values
    kv_token_bytes = shape["num_hidden_layers"] * shape["num_attention_heads"] * 4 * (
        shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"])
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with running_pair(model_dir, tmp_path) as driver:
        sent_before = 0
        for i, prompt in enumerate(PROMPTS):
            result = driver.generate([prompt], prefix=f"mla-{i}-", **GREEDY)[0]
            theirs, logits = hf_greedy(reference, prompt, GREEDY["max_tokens"])
            assert_greedy_match(result.token_ids, theirs, logits, f"deepseek-v3 1P1D prompt of {len(prompt)}")
            sent = driver.prefill_stats().kv_bytes_sent - sent_before
            assert sent == len(prompt) * token_bytes, f"prompt of {len(prompt)}"
            assert sent < len(prompt) * kv_token_bytes
            sent_before += sent
        decode_stats = driver.decode_stats()
        assert decode_stats.kv_bytes_received == sent_before and decode_stats.num_kv_transfers_failed == 0
        assert_no_leaks(driver)
