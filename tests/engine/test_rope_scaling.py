"""Rope scalings: pdserve's cos/sin table equals transformers' rotary bit for bit (scalings through
transformers' own ROPE_INIT_FUNCTIONS, yarn's attention factor included), sequence-dependent types and
incomplete scalings are refused with the reason, and Llama / Qwen2 with yarn generate what transformers generates."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pdserve.engine.layers.rotary import RotaryEmbedding, UnsupportedRopeError
from tests.engine.test_llm_parity import make_prompts, run_parity

HEAD_DIM, MAX_POSITIONS, THETA = 16, 128, 10000.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": YARN,
    "yarn-mscales": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.9},  # DeepSeek-V3's form
    "yarn-old-type-key": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


def _transformers_cos_sin(scaling: dict | None) -> torch.Tensor:  # [MAX_POSITIONS, HEAD_DIM]: cos | sin halves
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": THETA}
    config = LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=MAX_POSITIONS, rope_parameters=rope)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(MAX_POSITIONS)[None])
    half = HEAD_DIM // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


@pytest.mark.parametrize("case", list(SCALINGS))
def test_cos_sin_table_equals_transformers(case):
    """Bit for bit in fp32, the attention factor (yarn: 1.139, or mscale / mscale_all_dim) included."""
    ours = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA, SCALINGS[case]).cos_sin_cache
    assert torch.equal(ours, _transformers_cos_sin(SCALINGS[case]))


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    table = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA, YARN).cos_sin_cache
    cos, sin = table.chunk(2, dim=-1)
    torch.testing.assert_close(cos.square() + sin.square(), torch.full_like(cos, (0.1 * math.log(4.0) + 1) ** 2))


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_sequence_dependent_scalings_are_refused(rope_type):
    scaling = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 32,
               "short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [4.0] * (HEAD_DIM // 2)}
    with pytest.raises(UnsupportedRopeError, match=f"{rope_type}.*change with the sequence length"):
        RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA, scaling)


def test_incomplete_scaling_names_the_missing_key():
    with pytest.raises(UnsupportedRopeError, match="'llama3' needs 'low_freq_factor'"):
        RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA, {"rope_type": "llama3", "factor": 8.0})


def test_unknown_scaling_is_refused():
    with pytest.raises(UnsupportedRopeError, match="'stretchy'.*neither pdserve nor transformers"):
        RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA, {"rope_type": "stretchy", "factor": 2.0})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_yarn_greedy_matches_transformers_fp32(model_factory, arch):
    """Pretrained on 32 positions, stretched 4x: most prompts (up to 70 tokens, plus 12 generated) pass 32."""
    model_dir = model_factory(arch, rope_scaling=YARN)
    run_parity(model_dir, make_prompts(1024), max_num_batched_tokens=64)
