"""Structured output through `pdserve up` as real processes and the real openai client, disaggregated (1P1D: the
prefill engine samples the first token under the constraint, the decode engine the rest) and colocated:
OpenAI's response_format (json_schema, json_object, and the client's own `parse` path), vLLM's
structured_outputs and guided_* fields, streamed and whole, and the 400s of bad constraints, from the
router and from an engine. The model has random weights: every constraint here has a short, finite
language, so the request completes well within max_tokens."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.router.conftest import shared_layout_cluster

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size", "count"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
MESSAGES = [{"role": "user", "content": "Is it big? Answer in JSON."}]
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[0-9]{3}-(red|green)"
SEEDS = range(4)


class Answer(BaseModel):
    ok: bool
    size: Literal["small", "large"]


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tiny_model, tmp_path_factory, shared_layouts):
    yield from shared_layout_cluster(request.param, tiny_model, tmp_path_factory, shared_layouts)


def fits_schema(value: dict) -> bool:
    return (set(value) == {"ok", "size", "count"} and isinstance(value["ok"], bool)
            and value["size"] in ("small", "large") and type(value["count"]) is int and 0 <= value["count"] <= 9)


def complete(client, seed: int, max_tokens: int = 40, **extra_body):
    return client.completions.create(model="tiny", prompt="The answer:", max_tokens=max_tokens, temperature=1.0,
                                     seed=seed, extra_body=extra_body)


def test_chat_json_schema_output_parses_and_fits_the_schema(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in SEEDS:
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=response_format,
                                                  temperature=1.0, seed=seed, max_tokens=60)
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        content = choice.message.content
        assert fits_schema(json.loads(content)), content
        assert " " not in content, "compact JSON: no whitespace the schema does not need"


def test_the_openai_clients_parse_gives_the_object(client):
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions.parse
    for seed in SEEDS:
        response = parse(model="tiny", messages=MESSAGES, response_format=Answer, temperature=1.0, seed=seed,
                         max_tokens=60)
        parsed = response.choices[0].message.parsed
        assert isinstance(parsed, Answer), response
        assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra_body, fits", [
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
    ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ({"structured_outputs": {"grammar": 'start: "(" ("a" | "b") ("," ("a" | "b"))? ")"'}},
     lambda text: re.fullmatch(r"\((a|b)(,(a|b))?\)", text)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda text: fits_schema(json.loads(text))),
], ids=["choice", "guided_choice", "regex", "guided_regex", "grammar", "json"])
def test_completions_fit_vllms_constraints_streamed_and_whole(client, extra_body, fits):
    for seed in SEEDS:
        whole = complete(client, seed, **extra_body).choices[0]
        assert whole.finish_reason == "stop" and fits(whole.text), whole
        chunks = list(client.completions.create(model="tiny", prompt="The answer:", max_tokens=40, temperature=1.0,
                                                seed=seed, stream=True, extra_body=extra_body))
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_one_token_constraint_completes_at_once(client):
    """Each choice is one token: in 1P1D the prefill engine's first token completes the request."""
    for seed in SEEDS:
        response = complete(client, seed, guided_choice=["A", "B"])
        assert response.choices[0].text in ("A", "B") and response.choices[0].finish_reason == "stop"
        assert response.usage.completion_tokens == 1


def test_json_object_output_is_an_object(client):
    """On completions too (as vLLM takes it), through extra_body: the openai client has no such argument there."""
    json_object = {"type": "json_object"}
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=json_object,
                                          temperature=1.0, seed=1, max_tokens=20)
    completion = complete(client, 1, max_tokens=20, response_format=json_object)
    for text in (chat.choices[0].message.content, completion.choices[0].text):
        assert text.startswith("{"), text


@pytest.mark.parametrize("extra_body, param, words", [
    ({"guided_regex": "[0-9]{3"}, "guided_regex", "regex does not compile"),
    ({"structured_outputs": {"regex": "[a-z]+"}, "guided_choice": ["a"]}, "structured_outputs",
     "structured_outputs.regex and guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     "needs its schema"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra_body, param, words):
    for create, extra in ((client.chat.completions.create, {"messages": MESSAGES}),
                          (client.completions.create, {"prompt": "x"})):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="tiny", max_tokens=4, extra_body=extra_body, **extra)
        error = refused.value.body
        assert error["param"] == param and words in error["message"], error


def test_a_constraint_only_the_engines_tokenizer_refuses_is_a_400(client):
    """The router's check knows no tokenizer: a special token the model lacks is refused by the engines."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="unknown special token"):
            result = client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=stream,
                                               extra_body={"guided_grammar": "start: <|no_such_token|>"})
            list(result) if stream else None


def test_a_constraint_that_dead_ends_after_some_tokens_is_a_400(client):
    """It compiles, and no output can satisfy it: the engine finds the dead end after a few tokens. Before, the
    answer was '{"p":' with finish_reason "stop" (an outside probe); now the request's own fault, a 400."""
    looping = {"type": "object", "properties": {"p": {"$ref": "#/$defs/a"}}, "required": ["p"],
               "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be satisfied"):
        client.completions.create(model="tiny", prompt="x", max_tokens=12, extra_body={"guided_json": looping})
