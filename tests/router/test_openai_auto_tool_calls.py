"""tool_choice "auto" with `pdserve up --tool-call-parser hermes`, as real processes and the real openai client,
disaggregated (1P1D) and colocated. The model has random weights, so a regex (vLLM's structured_outputs, which
"auto" takes alongside since it constrains nothing itself) makes it write a Hermes answer: text, then
<tool_call>{...}</tool_call> blocks. The router reads them into tool_calls, whole and streamed through the
client's stream helper alike."""

from __future__ import annotations

import json

import pytest

from tests.router.conftest import layout_cluster

CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["UTC", "CET"]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK, "strict": True}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo, and the time?"}]
ANSWER = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>')
CALLS = [("weather", '{"city":"Oslo","days":2}'), ("clock", '{"zone":"UTC"}')]


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tiny_model, tmp_path_factory):
    yield from layout_cluster(request, tiny_model, tmp_path_factory, "auto-tools", "--tool-call-parser", "hermes")


def literal(text: str) -> str:
    """A regex matching exactly `text` (its metacharacters escaped; newlines and spaces as they are)."""
    return "".join(f"\\{c}" if c in ".^$*+?{}[]\\|()" else c for c in text)


def forced(text: str) -> dict:
    return {"structured_outputs": {"regex": literal(text)}}


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_the_models_hermes_calls_are_the_answers_tool_calls(client, tool_choice):
    choice_field = {"tool_choice": tool_choice} if tool_choice else {}
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                              extra_body=forced(ANSWER), **choice_field)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.", choice
    assert calls_of(choice.message) == CALLS
    assert all(call.type == "function" and call.id.startswith("chatcmpl-tool-") for call in choice.message.tool_calls)
    assert len({call.id for call in choice.message.tool_calls}) == 2


def test_the_stream_helper_gathers_the_same_calls(client):
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                        max_tokens=200, extra_body=forced(ANSWER)) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    assert calls_of(final.message) == CALLS
    assert [call.function.parsed_arguments for call in final.message.tool_calls] == [json.loads(a) for _, a in CALLS]
    done = [(event.name, event.arguments) for event in events if event.type == "tool_calls.function.arguments.done"]
    assert done == CALLS
    content = "".join(event.delta for event in events if event.type == "content.delta")
    assert content == "Let me check."


def test_a_call_the_output_ends_inside_is_read_up_to_the_end(client):
    """The output ends before the closing tag (the regex stops there, as max_tokens would cut it)."""
    answer = '<tool_call>\n{"name": "clock", "arguments": {"zone": "CET"}}'
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100, extra_body=forced(answer))
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                choice = events.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert calls_of(choice.message) == [("clock", '{"zone":"CET"}')]


def test_a_block_naming_no_tool_of_the_request_stays_text(client):
    answer = 'Hm.\n<tool_call>\n{"name": "radio", "arguments": {}}\n</tool_call>'
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                              max_tokens=100, extra_body=forced(answer))
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == answer and not choice.message.tool_calls


def test_free_text_without_a_regex_is_the_content(client):
    """Unconstrained, the random model writes text (never a whole call): content, finish_reason as the engine's."""
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, seed=1,
                                            temperature=1.0).choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert not choice.message.tool_calls
