"""Tool calling through `pdserve up` as real processes and the real openai client, disaggregated (1P1D) and
colocated: a named tool's call (whole, streamed through the client's stream helper, n > 1), tool_choice
"required" over two tools, a tool loop's messages sent back, and the 400s. The model has random weights:
every schema here has only short finite values (enums, booleans, small integers, no extra properties), so a
call completes well within max_tokens."""

from __future__ import annotations

import json

import openai
import pytest

from tests.router.conftest import shared_layout_cluster

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "celsius", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 3}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK, "strict": True}}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
SEEDS = range(4)


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tiny_model, tmp_path_factory, shared_layouts):
    yield from shared_layout_cluster(request.param, tiny_model, tmp_path_factory, shared_layouts)


def fits(name: str, arguments: dict) -> bool:
    if name == "clock":
        return arguments in ({"zone": "UTC"}, {"zone": "CET"})
    return (name == "weather" and set(arguments) == {"city", "celsius", "days"}
            and arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["celsius"], bool)
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 3)


def call_weather(client, seed: int, **extra):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER_CHOICE,
                                          temperature=1.0, seed=seed, max_tokens=80, **extra)


def test_a_named_tools_call_fits_its_schema(client):
    for seed in SEEDS:
        choice = call_weather(client, seed).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        call, = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "weather"
        assert fits("weather", json.loads(call.function.arguments)), call.function.arguments


def test_each_of_n_choices_calls_the_tool(client):
    response = call_weather(client, 7, n=2)
    calls = [choice.message.tool_calls[0] for choice in response.choices]
    assert len(calls) == 2 and calls[0].id != calls[1].id
    assert all(fits("weather", json.loads(call.function.arguments)) for call in calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_name_the_tools_and_fit_their_schemas(client, parallel):
    """A hot temperature: the random model's choices are peaked (at 1.0 every seed calls the same tool once); at 5.0
    these seeds (sampling is seeded, so the answers are fixed) call both tools, once two in one answer."""
    answers = []
    for seed in range(8):
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=parallel, temperature=5.0, seed=seed,
                                                  max_tokens=400)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1), calls
        for call in calls:
            assert fits(call.function.name, json.loads(call.function.arguments)), call
        answers.append([call.function.name for call in calls])
    if parallel:
        assert {name for names in answers for name in names} == {"weather", "clock"}, answers
        assert max(map(len, answers)) > 1, answers


def test_a_streamed_named_call_accumulates_to_the_whole_answers(client):
    """The openai client's stream helper gathers the argument pieces (and parses them: the tools are strict)."""
    for seed in SEEDS:
        whole = call_weather(client, seed).choices[0].message.tool_calls[0]
        with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER_CHOICE,
                                            temperature=1.0, seed=seed, max_tokens=80) as stream:
            pieces = [event.arguments_delta for event in stream if event.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion().choices[0]
        call, = final.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("weather", whole.function.arguments)
        assert call.function.parsed_arguments == json.loads(whole.function.arguments)
        assert len(pieces) > 1 and "".join(pieces) == whole.function.arguments  # streamed as it came
        assert final.finish_reason == "stop" and final.message.content is None


def test_a_tool_loop_conversation_is_accepted(client):
    """The assistant's tool_calls message (content null) and the tool's answer go back, as clients send them."""
    answer = call_weather(client, 3).choices[0].message
    loop = [*MESSAGES, answer, {"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "-3 C"}]
    reply = client.chat.completions.create(model="tiny", messages=loop, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls
    again = client.chat.completions.create(model="tiny", messages=loop, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=120)
    call, = again.choices[0].message.tool_calls
    assert fits(call.function.name, json.loads(call.function.arguments))


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": CLOCK}}


@pytest.mark.parametrize("extra, param, words", [
    ({}, "tool_choice", ['tool_choice "auto" needs a parser', "--tool-call-parser hermes",
                         'send tool_choice "required"']),
    ({"tool_choice": "auto"}, "tool_choice", ['"auto" needs a parser', "or drop `tools`"]),
    ({"tool_choice": {"type": "function", "function": {"name": "radio"}}}, "tool_choice",
     ["'radio', which is not among", "weather, clock"]),
    ({"tools": [tool("get weather")], "tool_choice": "required"}, "tools", ["breaks OpenAI's rule", "rename"]),
    ({"tools": [tool("clock"), tool("clock")], "tool_choice": "required"}, "tools", ["two tools are named 'clock'"]),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     ["response_format and tools", "drop response_format"]),
])
def test_tool_requests_this_server_cannot_serve_are_400s(client, extra, param, words):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **body)
    error = refused.value.body
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
