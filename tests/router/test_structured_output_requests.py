"""Structured output in the router (router/structured_output.py, router/schemas.py): OpenAI's response_format,
vLLM's structured_outputs and guided_* fields become the one constraint the engines get; a bad, unknown or
second constraint is a 400 naming the request's field before any engine sees the request; and the token
that completes a constraint is shown (TokenDelta.stopped_by_constraint), from the decode engine or as the
prefill engine's first token. Against scripted engines (tests/router/fake_engine.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.control.sampling_params import MAX_STRUCTURED_SPEC_CHARS
from pdserve.router.errors import InvalidRequest
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.specs import chat_specs, completion_specs
from pdserve.router.structured_output import asked_constraint, check_constraint
from tests.router.conftest import assert_refused, router_app
from tests.router.fake_engine import fake_tokens
from tests.router.test_engines_and_failures import PROMPT_IDS, completion, serving_engines
from tests.router.test_stop_rules import PREFILL, answer

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"],
          "properties": {"ok": {"type": "boolean"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def sampling_of(fields: dict):
    """The SamplingParams both endpoints build from a request with `fields` (they must agree)."""
    found = []
    for request in (CompletionRequest(prompt="x", **fields), ChatCompletionRequest(messages=MESSAGES, **fields)):
        constraint = asked_constraint(request)
        if constraint is not None:
            check_constraint(constraint)
        specs = completion_specs(request, [[7]], 512, None, 8, constraint=constraint) \
            if isinstance(request, CompletionRequest) else chat_specs(request, [7], 512, 8, constraint=constraint)
        found.append(specs[0].sampling_params)
    assert found[0].structured_kind == found[1].structured_kind and found[0].structured_spec == found[1].structured_spec
    return found[0]


@pytest.mark.parametrize("fields, kind, spec", [
    ({}, None, ""),
    ({"response_format": {"type": "text"}}, None, ""),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA_TEXT),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA_TEXT),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", json.dumps(SCHEMA)),  # JSON text as sent
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes","no"]'),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar", 'start: "a" | "b"'),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}}, "json_object", ""),
    ({"structured_outputs": {"regex": "x+", "json_object": False}}, "regex", "x+"),
    ({"guided_json": SCHEMA}, "json", SCHEMA_TEXT),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes","no"]'),
    ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ({"guided_regex": "a", "response_format": {"type": "text"}}, "regex", "a"),  # text is no constraint
    ({"guided_regex": None, "structured_outputs": None}, None, ""),  # nulls: not asked
])
def test_each_field_becomes_the_engines_constraint(fields, kind, spec):
    params = sampling_of(fields)
    assert (params.structured_kind, params.structured_spec) == (kind, spec)


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_json",
     ["2 structured outputs", "guided_json and guided_regex"]),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "x"}}, "response_format",
     ["response_format and structured_outputs.regex", "send only one"]),
    ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, "structured_outputs",
     ["structured_outputs.regex and structured_outputs.choice"]),
    ({"structured_outputs": {}}, "structured_outputs", ["names no constraint", "send one of json"]),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", ["names no constraint"]),
    ({"guided_regex": "[0-9"}, "guided_regex", ["guided_regex:", "regex does not compile", "unclosed"]),
    ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs",
     ["structured_outputs.grammar:", "grammar does not compile", "nothing"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objec"}}}},
     "response_format", ["response_format:", "does not compile", "objec"]),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", ["schema is not JSON"]),
    ({"guided_json": "[1, 2]"}, "guided_json", ["JSON schema is a JSON list", "as a JSON object"]),
    ({"guided_choice": ["yes", ""]}, "guided_choice", ["non-empty list of non-empty strings"]),
    ({"guided_regex": "x" * (MAX_STRUCTURED_SPEC_CHARS + 1)}, "guided_regex", ["over the limit", "smaller"]),
])
def test_bad_or_second_constraints_are_refused_by_field(fields, param, words):
    with pytest.raises(InvalidRequest) as refused:
        sampling_of(fields)
    assert refused.value.param == param, refused.value.body()
    for word in words:
        assert word in refused.value.message, refused.value.message


def _post(tiny_model, tokenization, engine_specs: list[dict], requests: list[tuple[str, dict]]):
    """[(status, body)] of each (path, body) posted to a router with these fake engines; and the engines."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, *engine_specs) as engines:
                return [await client.post(path, json=body) for path, body in requests], engines
    return asyncio.run(scenario())


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", ["response_format.type", "'json_schema'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     ["needs its schema", '"schema": {...}']),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
     ["response_format.json_schema.name"]),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     ["structured_outputs.structural_tag is not served", "send one of json"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["structured_outputs.choice"]),
    ({"guided_regex": "[0-9"}, "guided_regex", ["regex does not compile"]),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", ["guided_regex and guided_choice"]),
])
def test_refusals_are_400s_before_any_engine_sees_the_request(tiny_model, tokenization, fields, param, words):
    requests = [("/v1/completions", completion(**fields)), ("/v1/chat/completions", {"messages": MESSAGES, **fields})]
    responses, (engine,) = _post(tiny_model, tokenization, [{"engine_id": "d0"}], requests)
    assert_refused(responses, param, words)
    assert engine.generate_requests() == []


def test_both_engines_get_the_constraint(tiny_model, tokenization):
    body = completion(max_tokens=4, structured_outputs={"choice": ["&'", "x"]})
    (response,), engines = _post(tiny_model, tokenization, [PREFILL, {"engine_id": "d0"}], [("/v1/completions", body)])
    assert response.status_code == 200, response.text
    sent = [msg.sampling_params for engine in engines for msg in engine.received if hasattr(msg, "sampling_params")]
    assert len(sent) == 2 and {(p.structured_kind, p.structured_spec) for p in sent} == {("choice", '["&\'","x"]')}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_token_that_completes_the_constraint_is_shown(tiny_model, tokenization, path):
    """Unlike the engine's stop token (test_stop_rules): the constraint's last token is text."""
    script = fake_tokens(PROMPT_IDS, 4)  # & ' ( )
    body = completion(max_tokens=8, guided_regex=".*")
    if path.endswith("chat/completions"):
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": MESSAGES}
    got = answer(tiny_model, tokenization, [{"engine_id": "d0", "script": script, "completes_constraint": True}],
                 body, path)
    assert (got["text"], got["token_ids"], got["finish_reason"]) == ("&'()", script, "stop"), got
    assert got["stop_reason"] is None


def test_a_first_token_that_completes_the_constraint_on_the_prefill_engine_is_shown(tiny_model, tokenization):
    """A one-token constraint completes on the prefill engine: its first token ends the choice, with its text."""
    engines = [{**PREFILL, "completes_constraint": True}, {"engine_id": "d0", "token_delay_s": 5.0}]
    got = answer(tiny_model, tokenization, engines, completion(max_tokens=8, guided_choice=["&"]))
    assert (got["text"], got["token_ids"], got["finish_reason"]) == ("&", fake_tokens(PROMPT_IDS, 1), "stop"), got


@pytest.mark.parametrize("path,fields,words", [
    ("/v1/completions", {"guided_whitespace_pattern": " *"}, ["guided_whitespace_pattern is not served"]),
    ("/v1/chat/completions", {"echo": True}, ["echo is not served", "/v1/completions"]),
])
def test_vllm_fields_that_would_change_the_answer_are_refused_not_ignored(tiny_model, tokenization, path, fields,
                                                                          words):
    body = completion(**fields) if path == "/v1/completions" else {"messages": MESSAGES, **fields}
    responses, (engine,) = _post(tiny_model, tokenization, [{"engine_id": "d0"}], [(path, body)])
    for response in responses:
        assert response.status_code == 400, response.text
        assert all(word in response.json()["error"]["message"] for word in words), response.text
    assert engine.generate_requests() == []
