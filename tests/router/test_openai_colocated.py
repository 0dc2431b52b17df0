"""`pdserve up --num-prefill 0` (colocated: the decode engine prefills) with an API key, through the real
openai client: sampling parameters, logprobs, echo, n, models list, auth, and disconnects."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve import SamplingParams
from tests.router.conftest import openai_client, scrape, up_cluster, wait_no_kv_used

API_KEY = "sesame-test-key"
PROMPT = "def parse(text):\n    tokens ="


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    yield from up_cluster(tiny_model, tmp_path_factory, "up-colocated", "--num-prefill", "0", "--num-decode", "1",
                          "--served-model-name", "tiny", env={"PDSERVE_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster, api_key=API_KEY)


def test_api_key_is_required(cluster, client):
    for key in ("", "wrong-key"):
        anonymous = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key or "x", max_retries=0)
        if not key:
            anonymous = anonymous.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].model_extra["max_model_len"] == 512
    assert httpx.get(f"{cluster.url}/health").json() == {"status": "ok", "engines": {"prefill": 0, "decode": 1}}


def test_seeded_sampling_with_every_knob_equals_the_offline_engine(client, offline):
    """Seeded sampling with every knob set: the same tokens as the offline engine with the same knobs.
    That each knob arrives at all is checked where the engine's input is visible:
    test_engines_and_failures.py::test_every_sampling_parameter_reaches_the_engine_as_sent."""
    knobs = {"temperature": 0.8, "top_p": 0.9, "seed": 3, "presence_penalty": 0.2, "frequency_penalty": 0.1}
    extra = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
             "return_token_ids": True}
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, extra_body=extra, **knobs)
    choice = response.choices[0]
    params = SamplingParams(max_tokens=10, top_k=50, min_p=0.01, repetition_penalty=1.1, min_tokens=4,
                            ignore_eos=True, **knobs)
    expected = offline.generate({"prompt_token_ids": choice.model_extra["prompt_token_ids"]}, params)[0].outputs[0]
    assert choice.model_extra["token_ids"] == expected.token_ids


def test_logprobs_equal_the_offline_engine(client, offline):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = response.choices[0]
    expected = offline.generate({"prompt_token_ids": choice.model_extra["prompt_token_ids"]},
                                SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0].outputs[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    for token_id, logprob, top, candidates in zip(expected.token_ids, choice.logprobs.token_logprobs,
                                                  choice.logprobs.top_logprobs, expected.logprobs):
        assert logprob == pytest.approx(candidates[token_id], abs=1e-4)
        assert len(top) >= 2 and max(top.values()) == pytest.approx(max(candidates.values()), abs=1e-4)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = chat.choices[0]
    expected = offline.generate({"prompt_token_ids": chat.model_extra["prompt_token_ids"]},
                                SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    content = choice.logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for token_id, entry, candidates in zip(expected.token_ids, content, expected.logprobs):
        assert entry.logprob == pytest.approx(candidates[token_id], abs=1e-4)
        top = sorted(candidates.values(), reverse=True)[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top, abs=1e-4)


def test_token_id_prompts_echo_and_several_choices(client, offline):
    prompt_ids = offline.tokenizer.encode(PROMPT)
    response = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=5, temperature=0, n=2, echo=True,
                                         extra_body={"ignore_eos": True})
    expected = offline.generate({"prompt_token_ids": prompt_ids},
                                SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.text == PROMPT + expected.text for c in response.choices)
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == 10

    batch = client.completions.create(model="tiny", prompt=[PROMPT, "x = 1"], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert expected.text.startswith(batch.choices[0].text), "the batch's first prompt is the same prompt"


def test_disconnect_frees_the_colocated_engine(cluster):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "write a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as stream:
        assert sum(1 for _, line in zip(range(6), stream.iter_lines()) if line.startswith("data: ")) >= 3
    used = wait_no_kv_used(cluster.url, api_key=API_KEY)
    assert used == {(("engine", "decode-0"), ("role", "decode")): 0.0}
    metrics = scrape(cluster.url, API_KEY)
    assert metrics["pdserve_requests_in_flight"][()] == 0
    assert metrics["pdserve_time_to_first_token_seconds_count"][()] >= 1


def test_usage_reports_prefix_cache_hits(client):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens the engine took from its prefix
    cache, streamed or not. The engines use 4-token blocks: a repeated 40-token prompt hits 9 blocks
    (36 tokens); the 10th is recomputed, since at least one prompt token must run to sample from."""
    prompt_ids = list(range(300, 340))  # 40 tokens that no other test sends
    first = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 36
    stream = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 36


def test_refused_sampling_values_name_the_parameter(client):
    """SamplingParams' own checks (beyond the request schema's) name the request's field, in its words."""
    for extra, param, words in (({"temperature": 101}, "temperature", "temperature=101.0 must be at most 100"),
                                ({"stop": [f"s{i}" for i in range(17)]}, "stop", "stop has 17 items"),
                                ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids holds -1"),
                                ({"min_tokens": 5, "max_completion_tokens": 2}, "min_tokens",
                                 "min_tokens=5 must not exceed max_completion_tokens=2")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra)
        error = refused.value.body
        assert error["param"] == param and words in error["message"], error
