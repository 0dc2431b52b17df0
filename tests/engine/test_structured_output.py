"""Structured output on pdserve's own engine (llguidance matchers): every kind of constraint holds on
sampled output, the request stops as soon as its constraint is complete (the last token's text kept),
bad constraints are refused by name, and the logits mask equals the matcher's bitmask bit for bit."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.control.errors import InvalidSamplingParams
from pdserve import StructuredOutputsParams
from pdserve.engine.request import InvalidRequestError
from pdserve.engine.structured_output import unpack_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}}}
CHOICES = ["yes", "no", "maybe so", "a-b & c~d (x)"]
PROMPTS = ["Hello there", "The answer is", "x"]


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", block_size=4)


def sample(llm, constraint, seeds=range(6), **params) -> list:
    batch = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=constraint, **params)
             for seed in seeds]
    outputs = []
    for one in batch:  # several seeds, all prompts: random weights make each draw different
        outputs += [o.outputs[0] for o in llm.generate(PROMPTS, one)]
    assert llm.kv_cache_manager.num_used_blocks == 0
    return outputs


def test_choice_output_is_one_of_the_choices_and_stops_there(llm):
    for output in sample(llm, StructuredOutputsParams(choice=CHOICES)):
        assert output.text in CHOICES and output.finish_reason == "stop"


def test_regex_output_matches_whole(llm):
    pattern = r"[0-9]{3}-(red|green)"
    for output in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, output.text), output.text
        assert output.finish_reason == "stop"


def test_json_schema_output_parses_and_fits_the_schema(llm):
    for output in sample(llm, StructuredOutputsParams(json=SCHEMA)):
        value = json.loads(output.text)
        assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("small", "large")


def test_lark_grammar_output_is_a_sentence_of_it(llm):
    for output in sample(llm, StructuredOutputsParams(grammar='start: "(" ("a" | "b") ("," ("a" | "b"))? ")"')):
        assert re.fullmatch(r"\((a|b)(,(a|b))?\)", output.text), output.text


def test_json_object_output_starts_an_object_and_greedy_equals_itself(llm):
    constraint = StructuredOutputsParams(json_object=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
    first, again = (llm.generate(["Hi"], greedy)[0].outputs[0] for _ in range(2))
    assert first.text.startswith("{") and first.token_ids == again.token_ids


def test_unconstrained_requests_in_the_same_batch_are_not_masked(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    constrained = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [constrained] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text in CHOICES for o in mixed[len(PROMPTS):])


@pytest.mark.parametrize("constraint,words", [
    (StructuredOutputsParams(regex="[0-9]{3"), ["regex", "does not compile", "unclosed"]),
    (StructuredOutputsParams(json={"type": "no-such-type"}), ["json", "does not compile"]),
    (StructuredOutputsParams(json="{not json"), ["not JSON"]),
    (StructuredOutputsParams(grammar="start: undefined_rule"), ["grammar", "does not compile"]),
])
def test_bad_constraints_are_refused_by_name(llm, constraint, words):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["Hi"], SamplingParams(structured_outputs=constraint))
    for word in words:
        assert word in str(info.value)
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(InvalidSamplingParams, match="exactly one constraint"):
        StructuredOutputsParams(json=SCHEMA, regex="x")
    with pytest.raises(InvalidSamplingParams, match="exactly one constraint"):
        StructuredOutputsParams()
    with pytest.raises(InvalidSamplingParams, match="non-empty list of strings"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=[]))
    with pytest.raises(InvalidSamplingParams, match="needs its spec"):
        SamplingParams(structured_kind="regex")


def test_unpack_bitmask_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-(1 << 31), 1 << 31, (3, 4), generator=generator, dtype=torch.int64).to(torch.int32)
    allowed = unpack_bitmask(words, 100)
    for row in range(3):
        for token in range(100):
            word = int(words[row, token // 32]) & 0xFFFFFFFF
            assert bool(allowed[row, token]) == bool(word >> (token % 32) & 1)


def test_a_repeated_constraint_is_compiled_once_and_each_request_has_its_own_matcher(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", block_size=4)
    compiler = llm.engine.structured_output
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{3}-(red|green)"))
    outputs = llm.generate(PROMPTS * 2, params)  # six requests of one constraint, decoding side by side
    assert compiler.num_compiled == 1
    assert all(re.fullmatch(r"[0-9]{3}-(red|green)", o.outputs[0].text) for o in outputs)
    again = llm.generate(PROMPTS, params)
    assert compiler.num_compiled == 1
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[:len(PROMPTS)]]


def large_schema(num_fields: int = 300) -> dict:
    """A JSON schema over BACKGROUND_COMPILE_CHARS as text whose output is short: one required boolean (the
    other fields are definitions nothing refers to)."""
    definitions = {f"unused_{i}": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}} for i in range(num_fields)}
    return {"type": "object", "$defs": definitions, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}


def test_a_large_constraint_compiles_on_a_thread_while_other_requests_step(model_factory):
    from pdserve.engine.structured_output import BACKGROUND_COMPILE_CHARS

    llm = LLM(model_factory("llama"), dtype="float32", block_size=4)
    engine = llm.engine
    schema = large_schema()
    constrained = SamplingParams(temperature=0, max_tokens=400, structured_outputs=StructuredOutputsParams(json=schema))
    assert len(constrained.structured_spec) >= BACKGROUND_COMPILE_CHARS
    engine.add_request(engine.make_request("big", [5, 6, 7], constrained))
    engine.add_request(engine.make_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
    assert engine.compiling.get("big") is not None and "big" not in engine.scheduler.requests
    first = engine.step()  # the plain request runs at once; the large constraint is still compiling
    assert [d.request_id for d in first if d.token_ids] == ["plain"]
    finished, text_ids = set(), []
    while engine.has_work():
        for delta in engine.step():
            if delta.request_id == "big":
                text_ids += delta.token_ids
            if delta.finish_reason is not None:
                finished.add((delta.request_id, delta.finish_reason))
    assert finished == {("plain", "length"), ("big", "stop")}
    value = json.loads(llm.get_tokenizer().decode(text_ids))
    assert isinstance(value["ok"], bool)
    assert engine.kv_cache_manager.num_used_blocks == 0


def test_a_large_bad_constraint_fails_as_an_invalid_request_and_an_abort_while_compiling_ends_it(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", block_size=4)
    bad = large_schema()
    bad["properties"]["ok"] = {"$ref": "#/$defs/no_such_definition"}
    with pytest.raises(InvalidRequestError, match="does not compile"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(json=bad)))
    engine = llm.engine
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=large_schema(301)))
    engine.add_request(engine.make_request("gone", [5, 6, 7], params))
    assert engine.abort("gone")
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("gone", "abort")]
    assert engine.kv_cache_manager.num_used_blocks == 0 and not engine.scheduler.requests


def test_a_constraint_that_breaks_its_matcher_mid_way_fails_its_request_only(llm):
    """A regex naming a special token's text, which llguidance's mask allows and its parser then refuses
    (found by an outside probe: the long error text made the engine's message unsendable, and the engine
    exited)."""
    breaking = StructuredOutputsParams(regex="<\\|im_end\\|>(" + "q" * 5000 + ")?")
    with pytest.raises(InvalidRequestError, match="structured output failed after .* check the constraint"):
        llm.generate(["Hi"], SamplingParams(max_tokens=8, structured_outputs=breaking))
    assert llm.kv_cache_manager.num_used_blocks == 0
    assert llm.generate(["Hi"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=CHOICES)))[0].outputs[0].text in CHOICES


def test_a_long_error_text_is_clipped_not_refused():
    from pdserve.control.messages import TokenDelta
    from pdserve.control.schema import MAX_STR_LEN

    delta = TokenDelta(request_id="r", finish_reason="error", error="x" * (3 * MAX_STR_LEN))
    assert len(delta.error) == MAX_STR_LEN and delta.error.endswith("…")


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="a[^\\s\\S]"),
    StructuredOutputsParams(grammar='start: a\na: a "x"'),
    StructuredOutputsParams(json={"type": "object", "properties": {"p": {"$ref": "#/$defs/a"}}, "required": ["p"],
                                  "$defs": {"a": {"$ref": "#/$defs/a"}}}),
])
def test_a_constraint_that_can_never_be_satisfied_fails_instead_of_stopping(llm, constraint):
    """Found by an outside probe: these compiled, and the request stopped on EOS with output that does not fit
    (e.g. '{"p":'). Now the dead end fails the request as an invalid one."""
    with pytest.raises(InvalidRequestError, match="cannot be satisfied"):
        llm.generate(["Hi"], SamplingParams(max_tokens=12, structured_outputs=constraint))
    assert llm.kv_cache_manager.num_used_blocks == 0
