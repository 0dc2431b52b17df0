"""The model's generation_config.json supplies the sampling defaults a request leaves unset (vLLM's
behaviour); what a request sets wins. Offline API and the router's request -> SamplingParams step."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.specs import chat_specs, completion_specs

MODEL_DEFAULTS = {"max_new_tokens": 5, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                  "do_sample": True, "eos_token_id": []}  # no end token: runs to max_tokens


@pytest.fixture(scope="module")
def model_with_defaults(model_factory, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(model_factory("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return model_dir


def test_defaults_are_read_from_generation_config(model_with_defaults, tmp_path):
    defaults = load_generation_defaults(model_with_defaults)
    assert defaults == GenerationDefaults(max_tokens=5, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    assert load_generation_defaults(tmp_path) == GenerationDefaults(), "no file: no defaults"
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_generation_defaults(tmp_path) == GenerationDefaults(), "an unreadable file is ignored"
    assert load_generation_defaults(tmp_path / "missing") == GenerationDefaults()


def test_chat_request_takes_the_model_defaults_it_leaves_unset(model_with_defaults):
    defaults = load_generation_defaults(model_with_defaults)
    silent = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = chat_specs(silent, [1, 2, 3], 512, 8, defaults)[0].sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        5, 0.6, 0.9, 20, 1.1)
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0.0,
                                     top_k=0)
    params = chat_specs(explicit, [1, 2, 3], 512, 8, defaults)[0].sampling_params
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (40, 0.0, 0, 0.9)
    assert chat_specs(silent, [1] * 510, 512, 8, defaults)[0].sampling_params.max_tokens == 2, "capped by context"
    assert chat_specs(silent, [1, 2, 3], 512, 8)[0].sampling_params.max_tokens == 509, "no model default: the rest"


def test_completion_request_default_max_tokens_is_16_or_the_models_if_smaller(model_with_defaults):
    defaults = load_generation_defaults(model_with_defaults)
    assert completion_specs(CompletionRequest(prompt="x"), [[7]], 512, None, 8, defaults)[0].sampling_params \
        .max_tokens == 5
    assert completion_specs(CompletionRequest(prompt="x"), [[7]], 512, None, 8)[0].sampling_params.max_tokens == 16
    generous = GenerationDefaults(max_tokens=256)  # e.g. the demo model's: OpenAI's and vLLM's 16 still hold
    assert completion_specs(CompletionRequest(prompt="x"), [[7]], 512, None, 8, generous)[0].sampling_params \
        .max_tokens == 16
    assert completion_specs(CompletionRequest(prompt="x"), [[7] * 500], 512, None, 8, generous)[0].sampling_params \
        .max_tokens == 12, "capped by the context"
    null = CompletionRequest(prompt="x", max_tokens=None)
    assert completion_specs(null, [[7]], 512, None, 8, generous)[0].sampling_params.max_tokens == 16
    given = CompletionRequest(prompt="x", max_tokens=9)
    assert completion_specs(given, [[7]], 512, None, 8, defaults)[0].sampling_params.max_tokens == 9


def test_offline_generate_without_params_uses_the_model_defaults(model_with_defaults):
    llm = LLM(str(model_with_defaults), dtype="float32", num_kv_blocks=32)
    assert llm.get_default_sampling_params().max_tokens == 5
    assert llm.get_default_sampling_params().temperature == 0.6
    output = llm.generate({"prompt_token_ids": [5, 6, 7]})[0].outputs[0]
    assert len(output.token_ids) == 5 and output.finish_reason == "length"
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(output.token_ids) == 3, "the caller's SamplingParams win"


def test_out_of_range_or_non_finite_model_defaults_are_ignored_with_a_warning(tmp_path, caplog):
    """A generation_config.json value out of SamplingParams' range made every request that left it unset a 400
    naming a value the client never sent; JSON's Infinity crashed the router at start (OverflowError)."""
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": -1, "top_p": 5, "top_k": -7, "max_new_tokens": 0, "repetition_penalty": 0.5}')
    with caplog.at_level("WARNING"):
        defaults = load_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults(repetition_penalty=0.5), "the valid value is kept"
    assert "generation_config.json's temperature=-1" in caplog.text and "top_p=5" in caplog.text
    assert "max_new_tokens=0" in caplog.text and "top_k=-7" in caplog.text
    params = chat_specs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), [1, 2, 3], 512, 8,
                        defaults)[0].sampling_params
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 0.5)
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": Infinity, "temperature": NaN}')
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
