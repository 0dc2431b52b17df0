"""Decode steps through every decoder layer in one native call (engine/models/cpu_decode_layers.py): the same tokens
and logprobs, bit for bit, as the layers one by one; which models and steps take it; a corrupt slot refused."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.models import cpu_decode_layers as binder
from pdserve.kernels import cpu_decode_layers

pytestmark = pytest.mark.skipif(not cpu_decode_layers.available(), reason="the native CPU kernels do not build here")

# prompts of different lengths: sequences of one decode step end at different contexts and blocks
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 5 for j in range(9 + 23 * i)]} for i in range(6)]


class CountingStep:
    """Wraps a stack's NativeDecodeStep: counts the steps it took (returned a result) and those it passed on."""

    def __init__(self, step) -> None:
        self.step, self.taken, self.passed = step, 0, 0

    def __call__(self, hidden, rotation):
        done = self.step(hidden, rotation)
        self.taken += done is not None
        self.passed += done is None
        return done


def _llm(model_dir: str, **kwargs) -> LLM:
    options = dict(dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=False)
    return LLM(model_dir, **{**options, **kwargs})


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.kv_cache_manager.num_used_blocks == 0
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batched_tokens", [2048, 64])  # 64: prefill chunks share steps with decodes
def test_one_call_equals_the_layers_one_by_one(model_factory, arch, threads, batched_tokens):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = _llm(model_factory(arch), max_num_batched_tokens=batched_tokens)
        stack = llm.engine.runner.model.model
        assert isinstance(stack.native_decode, binder.NativeDecodeStep)
        counting = stack.native_decode = CountingStep(stack.native_decode)
        in_one_call = _generate(llm)
        stack.native_decode = None
        assert _generate(llm) == in_one_call
    finally:
        torch.set_num_threads(previous)
    assert counting.taken >= 19  # every decode-only step
    if batched_tokens == 64:
        assert counting.passed > 0  # steps with a prefill chunk ran layer by layer


@pytest.mark.parametrize("arch, overrides, dtype, reason", [
    ("mistral", {"sliding_window": 8}, "bfloat16", "sliding window"),
    ("llama", {}, "float32", "linears not on the bf16 kernel"),
])
def test_models_it_cannot_take_run_layer_by_layer(model_factory, arch, overrides, dtype, reason, caplog):
    caplog.set_level("INFO", logger=binder.__name__)
    llm = _llm(model_factory(arch, **overrides), dtype=dtype)
    assert llm.engine.runner.model.model.native_decode is None
    assert f"CPU decode steps: layer by layer" in caplog.text and reason in caplog.text
    assert all(len(tokens) == 20 for tokens, _ in _generate(llm))


def test_a_slot_past_the_cache_is_refused_with_a_sentence(model_factory):
    llm = _llm(model_factory("llama"))
    stack = llm.engine.runner.model.model
    _generate(llm)
    layers = stack.native_decode._layers()
    hidden = torch.randn(1, layers.shape.hidden, dtype=torch.bfloat16)
    cos_sin = torch.randn(1, layers.shape.head_dim, dtype=torch.bfloat16)
    cache = layers.layers[0].key_cache
    slots = torch.tensor([cache.shape[0] * cache.shape[1]], dtype=torch.int64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(IndexError, match="slot_mapping is corrupt"):
        layers.run(hidden, cos_sin, slots, tables, lens)
