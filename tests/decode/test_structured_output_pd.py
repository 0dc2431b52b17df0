"""Structured output across a real prefill/decode pair: the prefill engine samples the first token under
the constraint, the decode engine's matcher takes that token and constrains the rest, so the output
equals the colocated engine's token for token (seeded sampling) and fits the constraint."""

from __future__ import annotations

import json

from pdserve import SamplingParams
from pdserve import StructuredOutputsParams
from tests.decode.test_disaggregated import PROMPTS, assert_no_leaks, colocated_llm, running_pair

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}}}


def test_constrained_output_is_the_same_disaggregated_and_colocated(model_factory, tmp_path):
    model_dir = model_factory("llama")
    constraint = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 30, "structured_kind": constraint.structured_kind,
                "structured_spec": constraint.structured_spec}
    offline = colocated_llm(model_dir).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                SamplingParams(**sampling))
    with running_pair(model_dir, tmp_path) as driver:
        for remote in (True, False):
            results = driver.generate(PROMPTS, remote=remote, prefix=f"remote{remote}", **sampling)
            for result, expected in zip(results, offline):
                assert result.finish_reason == "stop", result.error
                assert result.token_ids == expected.outputs[0].token_ids
                value = json.loads(expected.outputs[0].text)
                assert set(value) == {"ok", "size"}
        assert_no_leaks(driver)


def test_a_bad_constraint_is_refused_by_both_engines(model_factory, tmp_path):
    model_dir = model_factory("llama")
    with running_pair(model_dir, tmp_path) as driver:
        result, = driver.generate([PROMPTS[1]], structured_kind="regex", structured_spec="[0-9]{3")
        assert result.finish_reason == "error" and "does not compile" in result.error
        assert_no_leaks(driver)
