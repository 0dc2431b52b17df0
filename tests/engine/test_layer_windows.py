"""Each layer's sliding window from config.json: layer_types, older configs' patterns, Qwen's max_window_layers."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.config import ConfigError, ModelConfig

SHAPE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2,
         "num_hidden_layers": 6, "max_position_embeddings": 128}


def windows(tmp_path, **fields) -> list[int | None]:
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **fields}))
    config = ModelConfig.from_hf(tmp_path)
    assert config.max_model_len == 128  # never capped at a window
    return [config.sliding_window_of(i) for i in range(config.num_layers)]


@pytest.mark.parametrize("fields, expected", [
    ({}, [None] * 6),
    ({"sliding_window": 8}, [8] * 6),  # Mistral: every layer
    ({"sliding_window": 8, "use_sliding_window": False}, [None] * 6),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 3}, [8, None] * 3),
    ({"sliding_window": 8, "sliding_window_pattern": 3}, [8, 8, None] * 2),
    ({"sliding_window": 8, "model_type": "gemma3_text"}, [8] * 5 + [None]),  # transformers' default pattern
    ({"sliding_window": 8, "model_type": "gemma2"}, [8, None] * 3),
    ({"sliding_window": 8, "max_window_layers": 4}, [None] * 4 + [8] * 2),  # Qwen2
])
def test_layer_windows(tmp_path, fields, expected):
    assert windows(tmp_path, **fields) == expected


def test_layer_types_of_another_length_are_named(tmp_path):
    with pytest.raises(ConfigError, match="`layer_types` must list one type per layer \\(6\\)"):
        windows(tmp_path, sliding_window=8, layer_types=["sliding_attention"])
