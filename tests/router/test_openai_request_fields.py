"""Request fields as OpenAI's API and vLLM treat them, through `pdserve up` and the real openai client:
explicit nulls mean the default, the retrieve-model call and /version answer, and fields that make no
sense together are a 400 naming the field rather than silently ignored."""

from __future__ import annotations

import importlib.metadata

import httpx
import openai
import pytest

from tests.router.conftest import shared_layout_cluster

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, shared_layouts):
    yield from shared_layout_cluster("colocated", tiny_model, tmp_path_factory, shared_layouts)


def test_explicit_nulls_take_the_defaults(client):
    """Clients that write every field send null for the ones the user left out (OpenAI: "number or null")."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
             "frequency_penalty": None, "logprobs": None}
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                          extra_body={**nulls, "temperature": 0, "top_k": None, "min_p": None,
                                                      "repetition_penalty": None})
    assert chat.choices[0].message.content == greedy.choices[0].message.content
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    completion = client.completions.create(model="tiny", prompt="x", extra_body={**nulls, "max_tokens": None,
                                                                                "echo": None, "logprobs": None})
    assert completion.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_a_model_can_be_retrieved_by_its_id(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_version_names_the_installed_pdserve(cluster):
    assert httpx.get(f"{cluster.url}/version").json() == {"version": importlib.metadata.version("pdserve")}


@pytest.mark.parametrize("body, param, words", [
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"tool_choice": "required"}, "tool_choice", "no `tools`"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "`functions` field is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "without `text`"),
])
def test_fields_that_cannot_apply_are_refused_by_name(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=body)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("continuous", [False, True])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client, continuous):
    """vLLM's stream_options.continuous_usage_stats; without it, only the last chunk carries usage."""
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    for create, extra in ((client.chat.completions.create, {"messages": MESSAGES}),
                          (client.completions.create, {"prompt": "x"})):
        chunks = list(create(model="tiny", max_tokens=5, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}, **extra))
        *with_choices, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 5
        usages = [chunk.usage for chunk in with_choices]
        if not continuous:
            assert usages == [None] * len(usages)
            continue
        counts = [usage.completion_tokens for usage in usages]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        assert {usage.prompt_tokens for usage in usages} == {last.usage.prompt_tokens}
