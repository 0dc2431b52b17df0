"""A structured-output constraint (SamplingParams.structured_kind / structured_spec) as llguidance's
grammar text, checked. Torch-free: the router checks a request's constraint with it before any engine
sees the request (`check_isolated`: the bounds, then a compile in a worker process), and each engine
again, isolated, before its own compile against its tokenizer (engine/structured_output.py)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.control.errors import InvalidRequestError
from pdserve.engine.grammar_limits import check_bounds
from pdserve.engine.grammar_sandbox import shared_sandbox

# llguidance's JSON options: no free whitespace between tokens (compact JSON), so a weak model cannot
# spend its max_tokens on spaces.
_JSON_OPTIONS = {"whitespace_flexible": False}


def check_isolated(kind: str, spec: str) -> None:
    """An InvalidRequestError naming the problem when the constraint is over a bound (engine/grammar_limits.py)
    or does not compile in a worker process (engine/grammar_sandbox.py), whose crash fails only this check."""
    check_bounds(kind, spec)
    problem = shared_sandbox().check(kind, spec)
    if problem:
        raise InvalidRequestError(problem)


def checked_grammar(kind: str, spec: str, tokenizer: Any = None) -> str:
    """The constraint's grammar text, compiled in this process: check_isolated it first; an
    InvalidRequestError naming the problem when it is over a bound or does not compile (against
    `tokenizer`, an llguidance LLTokenizer, when given; else the grammar alone)."""
    from llguidance import LLMatcher

    check_bounds(kind, spec)
    grammar = grammar_of(kind, spec)
    problem = LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        raise InvalidRequestError(f"the structured output's {kind} does not compile: {problem.strip()[:1000]}")
    return grammar


def grammar_of(kind: str, spec: str) -> str:
    """llguidance's grammar text of one constraint."""
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the structured output's JSON schema is not JSON ({exc}): send the schema "
                                      "as a JSON object") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"the structured output's JSON schema is a JSON {type(schema).__name__}: "
                                      "send the schema as a JSON object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the structured output's JSON schema does not compile: {exc}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(spec)
    return LLMatcher.grammar_from_lark(_choice_grammar(spec))


def _choice_grammar(spec: str) -> str:
    """A Lark grammar whose only sentences are the choices (spec: a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError("the structured output's choice must be a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
