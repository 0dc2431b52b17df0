"""The Hermes tool-call parser on text (router/hermes_tool_parser.py): calls, several calls, the text around them,
blocks that stay text (JSON that does not parse, a tool not in the request, arguments that are no object), calls
past parallel_tool_calls false dropped, output cut short, and the same pieces however the text is split into
deltas."""

from __future__ import annotations

import pytest

from pdserve.router.hermes_tool_parser import END, START, HermesToolParser, ParsedCall

NAMES = frozenset({"weather", "clock"})
WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CLOCK = '<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>'
WEATHER_CALL = ParsedCall(0, "weather", '{"city":"Oslo","days":2}')


def parsed(text: str, **options) -> list:
    """The pieces of a whole output (one feed), consecutive text joined."""
    parser = HermesToolParser(NAMES, **options)
    return joined(parser.feed(text) + parser.finish())


def streamed(parts: list[str], **options) -> list:
    parser = HermesToolParser(NAMES, **options)
    pieces = [piece for part in parts for piece in parser.feed(part)]
    return joined(pieces + parser.finish())


def joined(pieces: list) -> list:
    result: list = []
    for piece in pieces:
        if isinstance(piece, str) and result and isinstance(result[-1], str):
            result[-1] += piece
        else:
            result.append(piece)
    return result


# ---- whole outputs ----

def test_a_call_alone_is_the_call():
    assert parsed(WEATHER) == [WEATHER_CALL]


def test_several_calls_in_order_with_their_indexes():
    assert parsed(f"{WEATHER}\n{CLOCK}\n") == [WEATHER_CALL, ParsedCall(1, "clock", '{"zone":"UTC"}')]


def test_text_before_a_call_is_kept_less_the_whitespace_that_borders_the_call():
    assert parsed(f"Let me check.\n\n{WEATHER}") == ["Let me check.", WEATHER_CALL]
    assert parsed(f"  {WEATHER}  ") == [WEATHER_CALL]


def test_text_between_and_after_calls_is_kept_apart_from_the_text_before_them():
    """An outside probe saw "Sure.Done." for "Sure.\\n<call>\\nDone.": text on both sides of calls keeps one run
    of whitespace between them (the one after the calls, else the one before)."""
    assert parsed(f"A {WEATHER} and then {CLOCK} done.\n") == \
        ["A", WEATHER_CALL, " and then", ParsedCall(1, "clock", '{"zone":"UTC"}'), " done.\n"]
    assert "".join(p for p in parsed(f"Sure.\n{WEATHER}\nDone.") if isinstance(p, str)) == "Sure.\nDone."
    assert "".join(p for p in parsed(f"Sure. {WEATHER} ok {CLOCK}") if isinstance(p, str)) == "Sure. ok"
    assert "".join(p for p in parsed(f"Sure.\n\n{WEATHER}{CLOCK}Done.") if isinstance(p, str)) == "Sure.\n\nDone."
    assert parsed(f"{WEATHER}\n\nDone.") == [WEATHER_CALL, "Done."], "no text before: none kept"


def test_text_without_calls_is_kept_as_it_is():
    for text in ["", "Hello", "  Hello,\n world  \n", "a < b and <tool>", "x <tool_call", " <", "\n\n"]:
        assert "".join(parsed(text)) == text, text


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"</tool_call>',  # JSON that does not parse
    '<tool_call>{"name": "radio", "arguments": {}}</tool_call>',  # not one of the request's tools
    '<tool_call>{"name": ["weather"], "arguments": {}}</tool_call>',  # a name that is no string
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "clock", "arguments": "UTC"}</tool_call>',  # arguments that are no object
    '<tool_call>["clock"]</tool_call>',  # no object
    '<tool_call>{"name": "clock", "arguments": {"n": NaN}}</tool_call>',  # not JSON
    '<tool_call>{"name": "clock", "arguments": {"n": 1e999}}</tool_call>',  # no finite number
    '<tool_call>' + "[" * 100_000 + '</tool_call>',  # nested past the recursion limit
    '<tool_call></tool_call>',
])
def test_a_block_that_is_no_call_stays_text_and_the_other_calls_still_count(block):
    assert parsed(block) == [block]
    assert parsed(f"Hi {block} {WEATHER}") == [f"Hi {block}", WEATHER_CALL]


def test_arguments_are_compact_json_and_keep_their_characters():
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Zürich", "tags": [1, 2.5, {"a": null}]}}</tool_call>'
    assert parsed(text) == [ParsedCall(0, "weather", '{"city":"Zürich","tags":[1,2.5,{"a":null}]}')]


def test_a_call_without_arguments_has_an_empty_object():
    assert parsed('<tool_call>{"name": "clock"}</tool_call>') == [ParsedCall(0, "clock", "{}")]


def test_not_parallel_keeps_only_the_first_call():
    assert parsed(f"{WEATHER}\n{CLOCK}\nDone.", max_calls=1) == [WEATHER_CALL, "Done."]
    assert parsed(f'<tool_call>{{"name": "radio"}}</tool_call> {WEATHER}', max_calls=1) == \
        ['<tool_call>{"name": "radio"}</tool_call>', WEATHER_CALL]


# ---- output cut short (max_tokens) ----

@pytest.mark.parametrize("cut", ["", "\n", "\n</", "\n</tool_ca", "\n</tool_call"])
def test_a_call_cut_after_its_json_is_read_up_to_the_end(cut):
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}' + cut
    assert parsed(f"Sure. {text}") == ["Sure.", WEATHER_CALL]


def test_a_call_cut_inside_its_json_stays_text():
    text = 'Sure. <tool_call>\n{"name": "weather", "arguments": {"city": "Os'
    assert parsed(text) == [text]
    assert parsed(f"{WEATHER} {text}") == [WEATHER_CALL, text]


# ---- streamed: the same pieces however the text is split ----

OUTPUTS = [
    f"Let me check.\n{WEATHER}\n{CLOCK}\nDone.",
    f"{WEATHER}{CLOCK}",
    'a <tool_call>{"name": "radio"}</tool_call> b <tool_cal x </tool_call> <<tool_call>{"name": "clock"}</tool_call>',
    f"  text with <b>tags</b> and < signs  \n{WEATHER[:-5]}",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_in_two_gives_the_whole_outputs_pieces(text):
    whole = parsed(text)
    for at in range(len(text) + 1):
        assert streamed([text[:at], text[at:]]) == whole, at


@pytest.mark.parametrize("text", OUTPUTS)
def test_character_by_character_gives_the_whole_outputs_pieces(text):
    assert streamed(list(text)) == parsed(text)


@pytest.mark.parametrize("tag", [START, END])
def test_a_tag_split_at_every_position_is_still_a_tag(tag):
    text = f"Hi {WEATHER} there"
    start = text.index(tag)
    for at in range(start + 1, start + len(tag)):
        assert streamed([text[:at], text[at:]]) == ["Hi", WEATHER_CALL, " there"], at


def test_what_may_start_a_tag_is_held_until_it_is_known():
    parser = HermesToolParser(NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]
    assert parser.feed("s> more") == [" <tools> more"]
    assert parser.feed(" <") == []
    assert parser.feed("tool_call>") == []  # a call opened: nothing until it closes
    assert parser.feed('{"name": "clock"}') == []
    assert parser.feed("</tool_call>") == [ParsedCall(0, "clock", "{}")]
    assert parser.finish() == []


def test_text_streams_as_it_comes_less_trailing_whitespace():
    parser = HermesToolParser(NAMES)
    assert parser.feed("One two ") == ["One two"]
    assert parser.feed("three\n") == [" three"]
    assert parser.finish() == ["\n"]
