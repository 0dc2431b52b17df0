"""Tool calling in the router (router/tool_calls.py, router/schemas.py, router/responses.py' ToolCallFormatter
and AutoToolCallFormatter, engine/chat.py): the tools' rules, the tool choice -> the one JSON constraint the
engines get, the 400s (auto without --tool-call-parser, unknown or bad names, a second constraint), the tool
loop's messages rendered, and the answer's tool_calls, whole and streamed (accumulated by the openai client's own
stream state), tool_choice "auto" read by the Hermes parser among them. The formatters are fed ChoiceDeltas; the
HTTP tests run the router against scripted engines (tests/router/fake_engine.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import ValidationError

from pdserve.engine.chat import render_chat
from pdserve.engine.grammar import checked_grammar
from pdserve.router.config import TOOL_CALL_PARSERS, RouterConfig
from pdserve.router.errors import InvalidRequest
from pdserve.router.generation import ChoiceDelta
from pdserve.router.responses import AutoToolCallFormatter, Prompt, ToolCallFormatter
from pdserve.router.schemas import ChatCompletionRequest
from pdserve.router.structured_output import asked_constraint, check_constraint
from pdserve.router.tool_calls import ANY_OBJECT, OUTPUT_PARSERS, tool_calling, with_tags_shown
from tests.router.conftest import assert_refused, router_app
from tests.router.test_engines_and_failures import serving_engines

MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "celsius"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}}}
TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"],
        "$defs": {"Zone": {"enum": ["UTC", "CET"]}}}


def tool(name: str, parameters: dict | None = None, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function,
                                             **({"parameters": parameters} if parameters is not None else {})}}


TOOLS = [tool("get_weather", WEATHER, description="The weather in a city"), tool("get_time", TIME)]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": MESSAGES, **fields})


def constraint_of(**fields):
    body = request(**fields)
    constraint = asked_constraint(body, tool_calling(body))
    if constraint is not None:
        check_constraint(constraint)
    return constraint


# ---- the request's rules ----

@pytest.mark.parametrize("fields, words", [
    ({"tools": [tool("has space")]}, ["'has space' breaks OpenAI's rule", "rename the tool"]),
    ({"tools": [tool("x" * 65)]}, ["breaks OpenAI's rule", "1 to 64"]),
    ({"tools": [tool("")]}, ["breaks OpenAI's rule"]),
    ({"tools": [tool("a"), tool("b"), tool("a")]}, ["two tools are named 'a'", "its own name"]),
    ({"tools": [tool(f"t{i}") for i in range(129)]}, ["tools"]),
    ({"tools": [{"type": "retrieval"}]}, ["tools.0"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, ["tool_choice 'sometimes' is not served", '"required"']),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, ["tool_choice"]),
])
def test_bad_tools_are_refused_by_the_schema(fields, words):
    with pytest.raises(ValidationError) as refused:
        request(**fields)
    for word in words:
        assert word in str(refused.value), str(refused.value)


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": TOOLS}, "tool_choice", ['tool_choice "auto" needs a parser', "--tool-call-parser hermes",
                                       'send tool_choice "required"', "or drop `tools`"]),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", ['"auto" needs a parser', "--tool-call-parser"]),
    ({"tools": TOOLS, "tool_choice": named("get_news")}, "tool_choice",
     ["'get_news', which is not among", "get_weather, get_time", "name one of them"]),
    ({"tool_choice": "required"}, "tool_choice", ["no `tools`", "send the tools"]),
    ({"tool_choice": named("get_weather")}, "tool_choice", ["no `tools`"]),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", ["`functions` field is not supported",
                                                                    "as `tools`"]),
])
def test_tool_choices_this_server_cannot_serve_are_400s_naming_the_fix(fields, param, words):
    with pytest.raises(InvalidRequest) as refused:
        tool_calling(request(**fields))
    assert refused.value.param == param, refused.value.body()
    for word in words:
        assert word in refused.value.message, refused.value.message


@pytest.mark.parametrize("fields", [{}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "auto"},
                                    {"tool_choice": "none"}, {"tools": [], "tool_choice": None},
                                    {"functions": [{"name": "f"}], "function_call": "none"}])
def test_no_tool_call_asked_is_no_constraint(fields):
    assert tool_calling(request(**fields)) is None
    assert constraint_of(**fields) is None


# ---- the constraint ----

def test_a_named_tool_constrains_the_output_to_its_parameters():
    constraint = constraint_of(tools=TOOLS, tool_choice=named("get_weather"))
    assert (constraint.kind, json.loads(constraint.spec), constraint.param) == ("json", WEATHER, "tools")
    without = constraint_of(tools=[tool("ping")], tool_choice=named("ping"))
    assert json.loads(without.spec) == ANY_OBJECT


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_of_the_tools(parallel):
    constraint = constraint_of(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == (None if parallel else 1)
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {"name": {"const": "get_weather"}, "parameters": WEATHER}
    assert weather["required"] == ["name", "parameters"] and weather["additionalProperties"] is False
    # the tools' $defs move to the root, where their "#/$defs/..." references point
    assert time["properties"]["parameters"] == {k: v for k, v in TIME.items() if k != "$defs"}
    assert schema["$defs"] == TIME["$defs"]
    checked_grammar("json", constraint.spec)


def test_required_refuses_tools_whose_definitions_collide():
    other = {**TIME, "$defs": {"Zone": {"enum": ["PST"]}}}
    with pytest.raises(InvalidRequest) as refused:
        constraint_of(tools=[*TOOLS, tool("get_zone", other)], tool_choice="required")
    assert refused.value.param == "tools"
    assert "'get_time' and 'get_zone' both define $defs.Zone" in refused.value.message
    same = constraint_of(tools=[*TOOLS, tool("get_zone", TIME)], tool_choice="required")  # equal: shared
    assert json.loads(same.spec)["$defs"] == TIME["$defs"]


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[a-z]+"}},
    {"guided_choice": ["a", "b"]},
])
@pytest.mark.parametrize("tool_choice", ["required", named("get_weather")])
def test_tools_with_another_constraint_are_a_400_naming_both(fields, tool_choice):
    with pytest.raises(InvalidRequest) as refused:
        constraint_of(tools=TOOLS, tool_choice=tool_choice, **fields)
    field = next(iter(fields))
    assert refused.value.param == field
    assert field in refused.value.message and " and tools (tool_choice " in refused.value.message, refused.value.message
    assert f"drop {field}, or set tool_choice to \"none\"" in refused.value.message


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_the_tool():
    with pytest.raises(InvalidRequest) as refused:
        constraint_of(tools=[tool("broken", {"type": "objec"})], tool_choice=named("broken"))
    assert refused.value.param == "tools"
    assert "the parameters of tool 'broken': " in refused.value.message and "does not compile" in refused.value.message


# ---- the answer ----

def formatter(tokenization, tool_choice, n: int = 1, **fields) -> ToolCallFormatter:
    calling = tool_calling(request(tools=TOOLS, tool_choice=tool_choice))
    return ToolCallFormatter("abc", model="tiny", tokenization=tokenization, prompts=[Prompt("p", [1, 2])], n=n,
                             num_logprobs=None, return_token_ids=False, include_usage=False, tool_calling=calling,
                             **fields)


def deltas(pieces: list[str], finish_reason: str = "stop", index: int = 0) -> list[ChoiceDelta]:
    return [ChoiceDelta(index, piece, [7], finish_reason=finish_reason if i == len(pieces) - 1 else None)
            for i, piece in enumerate(pieces)]


def whole(fmt: ToolCallFormatter, events: list[ChoiceDelta]) -> dict:
    for event in events:
        fmt.totals[event.index].add(event)
    return fmt.body()


def streamed(fmt: ToolCallFormatter, events: list[ChoiceDelta]) -> list[dict]:
    chunks = fmt.role_chunks()
    return chunks + [chunk for chunk in map(fmt.chunk, events) if chunk is not None]


def accumulated(chunks: list[dict]):
    """What the openai client's stream helpers make of the chunks."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


ARGUMENTS = ['{"city":', '"Oslo","cel', 'sius":true}']


def test_a_named_tool_answers_with_its_call(tokenization):
    body = whole(formatter(tokenization, named("get_weather")), deltas(ARGUMENTS))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    call, = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == len("chatcmpl-tool-") + 32
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": "".join(ARGUMENTS)}


def test_a_named_tool_streams_its_arguments_as_they_come(tokenization):
    chunks = streamed(formatter(tokenization, named("get_weather")), deltas(ARGUMENTS))
    first, *rest = [chunk["choices"][0] for chunk in chunks]
    header, = first["delta"]["tool_calls"]
    assert first["delta"]["role"] == "assistant" and first["delta"]["content"] is None
    assert header["index"] == 0 and header["id"].startswith("chatcmpl-tool-") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert [c["delta"]["tool_calls"] for c in rest] == [[{"index": 0, "function": {"arguments": a}}] for a in ARGUMENTS]
    assert [c["finish_reason"] for c in rest] == [None, None, "stop"]
    message = accumulated(chunks).choices[0].message
    assert message.content is None and message.tool_calls[0].id == header["id"]
    assert (message.tool_calls[0].function.name, message.tool_calls[0].function.arguments) == \
        ("get_weather", "".join(ARGUMENTS))


CALLS = ('[{"name":"get_weather","parameters":{"city":"Paris","celsius":false}},'
         '{"name":"get_time","parameters":{"zone":"UTC"}}]')
CALL_PIECES = [CALLS[:10], CALLS[10:50], CALLS[50:]]


def test_required_answers_with_each_item_as_a_call(tokenization):
    body = whole(formatter(tokenization, "required"), deltas(CALL_PIECES))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city":"Paris","celsius":false}'), ("get_time", '{"zone":"UTC"}')]
    assert len({c["id"] for c in calls}) == 2


def test_required_streams_its_calls_whole_once_complete(tokenization):
    chunks = streamed(formatter(tokenization, "required"), deltas(CALL_PIECES))
    role, last = [chunk["choices"][0] for chunk in chunks]  # nothing between: the calls go whole
    assert role["delta"] == {"role": "assistant", "content": None}
    assert last["finish_reason"] == "tool_calls" and [c["index"] for c in last["delta"]["tool_calls"]] == [0, 1]
    message = accumulated(chunks).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [("get_weather", '{"city":"Paris","celsius":false}'), ("get_time", '{"zone":"UTC"}')]


def test_required_output_cut_short_stays_the_content(tokenization):
    cut = deltas(CALL_PIECES[:2], finish_reason="length")
    choice = whole(formatter(tokenization, "required"), cut)["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "".join(CALL_PIECES[:2])
    last = streamed(formatter(tokenization, "required"), cut)[-1]["choices"][0]
    assert last["delta"] == {"content": "".join(CALL_PIECES[:2])} and last["finish_reason"] == "length"


def test_each_of_n_choices_has_its_own_calls(tokenization):
    events = deltas(ARGUMENTS, index=0) + deltas(['{"city":"Paris","celsius":false}'], index=1)
    calls = [c["message"]["tool_calls"][0] for c in whole(formatter(tokenization, named("get_weather"), n=2),
                                                            events)["choices"]]
    assert calls[0]["id"] != calls[1]["id"] and calls[1]["function"]["arguments"] == '{"city":"Paris","celsius":false}'
    chunks = streamed(formatter(tokenization, named("get_weather"), n=2), events)
    choices = accumulated(chunks).choices
    assert [c.message.tool_calls[0].function.arguments for c in choices] == \
        ["".join(ARGUMENTS), '{"city":"Paris","celsius":false}']


# ---- the prompt: tools and a tool loop through the chat template ----

LOOP = [*MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city":"Oslo","celsius":true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]
TOOL_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                 "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")


def test_a_template_that_knows_tools_gets_them_and_the_calls_arguments_as_objects(tokenization):
    text = render_chat(tokenization.tokenizer, LOOP, add_generation_prompt=False, tools=TOOLS,
                       chat_template=TOOL_TEMPLATE)
    assert text == ("[tool get_weather][tool get_time]<user>What is the weather?<assistant>get_weather(Oslo)"
                    "<tool>-3#call_1")


def test_the_tool_loops_messages_render_with_the_models_template(tokenization):
    text, token_ids = tokenization.chat_prompt(request(messages=LOOP, tools=TOOLS, tool_choice="none"))
    assert "<|im_start|>tool\n-3<|im_end|>" in text and token_ids


@pytest.mark.parametrize("depth", [990, 50_000])
def test_tool_call_arguments_nested_too_deeply_to_read_are_a_400_not_a_500(tokenization, depth):
    """An outside probe: a RecursionError from Python's JSON reader reached the client as a 500 (and a traceback
    in the router's log)."""
    deep = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"a":' * depth + "1" + "}" * depth}}]}]
    with pytest.raises(InvalidRequest, match="`arguments` nest too deeply to read") as info:
        tokenization.chat_prompt(request(messages=deep, tools=TOOLS, tool_choice="none"))
    assert info.value.param == "messages"


# ---- through the router's HTTP API ----

def post(tiny_model, tokenization, engine_specs: list[dict], bodies: list[dict]):
    """The responses to each chat body (each also streamed when it says so), and the engines."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, *engine_specs) as engines:
                return [await client.post("/v1/chat/completions", json=body) for body in bodies], engines
    return asyncio.run(scenario())


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": TOOLS}, "tool_choice", ['"auto" needs a parser', "--tool-call-parser hermes"]),
    ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice", ["'nope', which is not among"]),
    ({"tools": [tool("a b")], "tool_choice": "required"}, "tools", ["breaks OpenAI's rule"]),
    ({"tools": [tool("a"), tool("a")], "tool_choice": "required"}, "tools", ["two tools are named 'a'"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     ["response_format and tools", 'set tool_choice to "none"']),
])
def test_refusals_are_400s_before_any_engine_sees_the_request(tiny_model, tokenization, fields, param, words):
    responses, (engine,) = post(tiny_model, tokenization, [{"engine_id": "d0"}],
                                [{"messages": MESSAGES, **fields}, {"messages": MESSAGES, "stream": True, **fields}])
    assert_refused(responses, param, words)
    assert engine.generate_requests() == []


def test_the_engines_run_the_tools_constraint_and_the_answer_is_its_calls(tiny_model, tokenization):
    script = tokenization.tokenizer.encode(CALLS, add_special_tokens=False)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200}
    (whole_response, stream_response), (engine,) = post(
        tiny_model, tokenization, [{"engine_id": "d0", "script": script, "completes_constraint": True}],
        [body, {**body, "stream": True}])
    sent = engine.generate_requests()[0].sampling_params
    assert sent.structured_kind == "json" and json.loads(sent.structured_spec)["minItems"] == 1
    choice = whole_response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    chunks = [json.loads(line[6:]) for line in stream_response.text.splitlines() if line.startswith("data: {")]
    message = accumulated(chunks).choices[0].message
    assert [c.function.arguments for c in message.tool_calls] == \
        [c["function"]["arguments"] for c in choice["message"]["tool_calls"]]


# ---- tool_choice "auto" with --tool-call-parser hermes ----

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
HERMES_CALLS = [("get_weather", '{"city":"Oslo","celsius":true}'), ("get_time", '{"zone":"CET"}')]


def test_the_parsers_the_config_names_are_the_ones_served(tiny_model):
    assert set(TOOL_CALL_PARSERS) == set(OUTPUT_PARSERS)
    with pytest.raises(ValueError, match="tool-call parser 'mistral' is unknown: use one of hermes"):
        RouterConfig(model=tiny_model, served_model_name="tiny", tool_call_parser="mistral")


def test_vllms_enable_auto_tool_choice_flag_is_taken_with_a_parser_and_refused_without(tiny_model):
    """A vLLM command line runs as it is: --enable-auto-tool-choice --tool-call-parser hermes."""
    from pdserve.cli import build_parser
    from pdserve.router_cli import router_config

    parser = build_parser()
    base = ["router", "--model", tiny_model, "--insecure", "--registration-address", "tcp://127.0.0.1:0"]
    config = router_config(parser.parse_args([*base, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert config.tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser: add --tool-call-parser hermes"):
        router_config(parser.parse_args([*base, "--enable-auto-tool-choice"]))


@pytest.mark.parametrize("fields", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}])
def test_auto_with_a_parser_reads_the_output_and_constrains_nothing(fields):
    calling = tool_calling(request(**fields), "hermes")
    assert calling.parser == "hermes" and not calling.constrains and calling.choice == 'tool_choice "auto"'
    assert asked_constraint(request(**fields), calling) is None


def test_auto_takes_the_requests_own_constraint_alongside():
    body = request(tools=TOOLS, structured_outputs={"regex": "<tool_call>[a-z]+</tool_call>"})
    constraint = asked_constraint(body, tool_calling(body, "hermes"))
    assert (constraint.kind, constraint.spec, constraint.param) == ("regex", "<tool_call>[a-z]+</tool_call>",
                                                                   "structured_outputs")


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tool_choice": "required"},
                                    {"tool_choice": named("get_time")}])
def test_a_parser_changes_no_other_tool_choice(fields):
    calling = tool_calling(request(tools=TOOLS, **fields), "hermes")
    plain = tool_calling(request(tools=TOOLS, **fields))
    assert calling == plain and (calling is None or calling.constrains)


def test_auto_keeps_special_tokens_in_the_text_unless_the_request_says():
    auto, told = request(tools=TOOLS), request(tools=TOOLS, skip_special_tokens=True)
    assert with_tags_shown(auto, tool_calling(auto, "hermes")).skip_special_tokens is False
    assert with_tags_shown(told, tool_calling(told, "hermes")).skip_special_tokens is True
    required = request(tools=TOOLS, tool_choice="required")
    assert with_tags_shown(required, tool_calling(required, "hermes")) is required


def auto_formatter(tokenization, n: int = 1, parallel: bool = True, **fields) -> AutoToolCallFormatter:
    calling = tool_calling(request(tools=TOOLS, parallel_tool_calls=parallel), "hermes")
    return AutoToolCallFormatter("abc", model="tiny", tokenization=tokenization, prompts=[Prompt("p", [1, 2])], n=n,
                                 num_logprobs=None, return_token_ids=False, include_usage=False, tool_calling=calling,
                                 **fields)


def auto_streamed(fmt: AutoToolCallFormatter, events: list[ChoiceDelta]) -> list[dict]:
    return fmt.role_chunks() + [chunk for event in events for chunk in fmt.chunks(event)]


def gathered(chunks: list[dict]):
    """What the openai client's stream state holds once every chunk is in (get_final_completion refuses an
    answer that ended with "length")."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.current_completion_snapshot


def split(text: str, *ats: int) -> list[str]:
    bounds = [0, *ats, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def calls_of(message) -> list[tuple[str, str]]:
    if isinstance(message, dict):
        return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_auto_answers_with_the_text_before_and_the_calls(tokenization):
    choice = whole(auto_formatter(tokenization), deltas([HERMES]))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert calls_of(choice["message"]) == HERMES_CALLS
    ids = [call["id"] for call in choice["message"]["tool_calls"]]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2
    assert all(call["type"] == "function" for call in choice["message"]["tool_calls"])


@pytest.mark.parametrize("text, content", [
    ("Just text.", "Just text."),
    ("", None),
    ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', '<tool_call>{"name": "get_news", '
                                                                     '"arguments": {}}</tool_call>'),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', '<tool_call>{"name": "get_time", '
                                                                          '"arguments": {"zone": </tool_call>'),
])
def test_auto_without_a_call_answers_with_the_text(tokenization, text, content):
    choice = whole(auto_formatter(tokenization), deltas([text]))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == content
    assert "tool_calls" not in choice["message"]


def test_auto_cut_by_max_tokens_reads_what_it_can_and_says_tool_calls_as_vllm_does(tokenization):
    after_json = HERMES[:HERMES.index("</tool_call>\n<tool_call>") + 4]  # the first call's end tag cut
    choice = whole(auto_formatter(tokenization), deltas([after_json], finish_reason="length"))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and calls_of(choice["message"]) == HERMES_CALLS[:1]
    inside_json = HERMES[:HERMES.index("CET")]  # the second call cut in its JSON: it stays text
    choice = whole(auto_formatter(tokenization), deltas([inside_json], finish_reason="length"))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and calls_of(choice["message"]) == HERMES_CALLS[:1]
    assert choice["message"]["content"] == "Let me look.\n" + inside_json[inside_json.rindex("<tool_call>"):]
    choice = whole(auto_formatter(tokenization), deltas([HERMES[:30]], finish_reason="length"))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == HERMES[:30]


def test_auto_not_parallel_keeps_the_first_call_only(tokenization):
    choice = whole(auto_formatter(tokenization, parallel=False), deltas([HERMES]))["choices"][0]
    assert calls_of(choice["message"]) == HERMES_CALLS[:1] and choice["message"]["content"] == "Let me look."
    streamed_calls = accumulated(auto_streamed(auto_formatter(tokenization, parallel=False), deltas(split(HERMES, 90))))
    assert calls_of(streamed_calls.choices[0].message) == HERMES_CALLS[:1]


def test_auto_streams_text_then_each_call_as_a_header_and_its_arguments(tokenization):
    chunks = auto_streamed(auto_formatter(tokenization), deltas(split(HERMES, 8, 17, 40, 110)))
    role, *rest = [chunk["choices"][0] for chunk in chunks]
    assert role["delta"] == {"role": "assistant", "content": None}
    text = "".join(c["delta"].get("content") or "" for c in rest)
    assert text == "Let me look."
    pieces = [c["delta"]["tool_calls"][0] for c in rest if "tool_calls" in c["delta"]]
    assert [set(p) for p in pieces] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert [p["index"] for p in pieces] == [0, 0, 1, 1]
    assert [p["function"] for p in pieces] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": HERMES_CALLS[0][1]},
        {"name": "get_time", "arguments": ""}, {"arguments": HERMES_CALLS[1][1]}]
    assert [c["finish_reason"] for c in rest][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in rest[:-1])


@pytest.mark.parametrize("text", [HERMES, "Just text, <b>no</b> calls <tool", HERMES[:HERMES.index("CET")],
                                  '  <tool_call>{"name": "get_news"}</tool_call> <tool_call>{"name": "get_time"}'])
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_auto_streamed_at_every_split_accumulates_to_the_whole_answer(tokenization, text, finish_reason):
    """What the openai client's stream helper gathers equals the whole answer: content, calls, finish_reason."""
    body = whole(auto_formatter(tokenization), deltas([text], finish_reason))["choices"][0]
    for at in range(0, len(text) + 1, 3):
        final = gathered(auto_streamed(auto_formatter(tokenization), deltas(split(text, at), finish_reason)))
        message = final.choices[0].message
        assert message.content == body["message"]["content"], at
        assert calls_of(message) == calls_of(body["message"]), at
        assert final.choices[0].finish_reason == body["finish_reason"], at


def test_auto_each_of_n_choices_has_its_own_parser(tokenization):
    events = deltas(split(HERMES, 50), index=0) + deltas(["Plain."], index=1)
    events = [events[0], events[2], events[1]]  # interleaved, as the engines send them
    body = whole(auto_formatter(tokenization, n=2), events)
    assert [calls_of(c["message"]) for c in body["choices"]] == [HERMES_CALLS, []]
    choices = accumulated(auto_streamed(auto_formatter(tokenization, n=2), events)).choices
    assert [calls_of(c.message) for c in choices] == [HERMES_CALLS, []]
    assert [c.message.content for c in choices] == ["Let me look.", "Plain."]


def test_auto_through_the_router_reads_the_engines_output(tiny_model, tokenization):
    """No constraint goes to the engine for "auto"; the request's own regex does; the answer is the parsed calls."""
    script = tokenization.tokenizer.encode(HERMES, add_special_tokens=False)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200}
    with_regex = {**body, "tool_choice": "auto", "structured_outputs": {"regex": "(.|\n)*"},
                  "skip_special_tokens": True}

    async def scenario():
        async with router_app(tiny_model, tokenization, tool_call_parser="hermes") as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "script": script,
                                                 "completes_constraint": True}) as engines:
                return [await client.post("/v1/chat/completions", json=b)
                        for b in (body, {**body, "stream": True}, with_regex)], engines
    (whole_response, stream_response, regex_response), (engine,) = asyncio.run(scenario())
    sent = [request.sampling_params for request in engine.generate_requests()]
    assert [(p.structured_kind, p.structured_spec) for p in sent] == [(None, ""), (None, ""), ("regex", "(.|\n)*")]
    assert [p.skip_special_tokens for p in sent] == [False, False, True]  # the tags shown, unless the request says
    for response in (whole_response, regex_response):
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
        assert calls_of(choice["message"]) == HERMES_CALLS
    chunks = [json.loads(line[6:]) for line in stream_response.text.splitlines() if line.startswith("data: {")]
    final = accumulated(chunks).choices[0]
    assert calls_of(final.message) == HERMES_CALLS and final.message.content == "Let me look."
    assert final.finish_reason == "tool_calls"
