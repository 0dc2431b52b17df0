"""Hostile structured-output payloads, by class: each builder makes the class's payload of size n, and each
class names its bound (engine/grammar_limits.py), a size over it, the largest size under it, and words its
refusal holds. Shared by the engine's and the router's hostile tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.grammar_limits import (MAX_ALTERNATIVES, MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEFS,
                                           MAX_SCHEMA_REFS)


def lark_rule_chain(n: int) -> str:
    """start -> r0 -> r1 -> ... -> rn: n + 2 rules, a chain n + 2 deep (crashed llguidance from ~2,700)."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(n)), f'r{n}: "a"'])


def lark_flat_rules(n: int) -> str:
    return "start: " + " | ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(f'r{i}: "w{i}"' for i in range(n))


def lark_nesting(n: int) -> str:
    return "start: " + "(" * n + '"a"' + ")" * n


def lark_alternation(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n))


def lark_embedded_schema_chain(n: int) -> str:
    return "start: %json " + schema_defs_chain(n)


def schema_defs_chain(n: int) -> str:
    """$defs d0 -> d1 -> ... each an object whose one property refers to the next (crashed from ~930)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def schema_ref_chain(n: int) -> str:
    """$defs each only a $ref to the next (crashed from ~2,550)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def schema_ref_graph(n: int) -> str:
    """Each definition refers to the next twice (a graph whose unfolded tree is 2^n wide)."""
    def refs(i: int) -> dict:
        following = {"$ref": f"#/$defs/d{i + 1}"}
        return {"anyOf": [following, {"type": "array", "items": following}]}

    defs = {f"d{i}": refs(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def schema_many_refs(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(n)},
                       "$defs": {"leaf": {"type": "integer"}}})


def schema_flat_defs(n: int) -> str:
    return json.dumps({"type": "object", "properties": {"p": {"$ref": "#/$defs/d0"}},
                       "$defs": {f"d{i}": {"type": "integer"} for i in range(n)}})


def schema_nested_objects(n: int) -> str:
    return '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + '},"required":["a"]}' * n


def schema_nested_arrays(n: int) -> str:
    return '{"type":"array","items":' * n + '{"type":"string"}' + "}" * n


def schema_enum(n: int) -> str:
    return json.dumps({"enum": [f"v{i}" for i in range(n)]})


def schema_any_of(n: int) -> str:
    return json.dumps({"anyOf": [{"const": f"v{i}"} for i in range(n)]})


def regex_nesting(n: int) -> str:
    return "(" * n + "a" + ")" * n


def regex_alternation(n: int) -> str:
    return "|".join(f"w{i}" for i in range(n))


def choice_list(n: int) -> str:
    return json.dumps([f"c{i}" for i in range(n)])


@dataclass(frozen=True)
class PayloadClass:
    name: str
    kind: str  # SamplingParams.structured_kind
    build: Callable[[int], str]
    over: int  # a size over the bound
    under: int  # the largest size under it
    words: tuple[str, ...]  # in the refusal

    def spec(self, n: int) -> str:
        return self.build(n)


_DEPTH = (f"nests deeper than the limit of {MAX_GRAMMAR_DEPTH}",)
_WIDTH = (f"over the limit of {MAX_ALTERNATIVES:,}",)
CLASSES = [
    PayloadClass("lark rule chain", "grammar", lark_rule_chain, 3_000, MAX_GRAMMAR_DEPTH - 3,
                 ("rules and terminals", f"limit of {MAX_GRAMMAR_RULES:,}")),
    PayloadClass("lark rule chain, deep", "grammar", lark_rule_chain, MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_DEPTH - 3, _DEPTH),
    PayloadClass("lark flat rules", "grammar", lark_flat_rules, MAX_GRAMMAR_RULES, MAX_GRAMMAR_RULES - 1,
                 ("rules and terminals",)),
    PayloadClass("lark nesting", "grammar", lark_nesting, 1_000, MAX_GRAMMAR_DEPTH - 1, _DEPTH),
    PayloadClass("lark alternation", "grammar", lark_alternation, MAX_ALTERNATIVES + 1, MAX_ALTERNATIVES,
                 ("alternatives", *_WIDTH)),
    PayloadClass("lark embedded schema chain", "grammar", lark_embedded_schema_chain, 1_000, 60,
                 ("$defs",)),
    PayloadClass("schema $defs chain", "json", schema_defs_chain, 2_500, 60, ("$defs", f"limit of {MAX_SCHEMA_DEFS}")),
    PayloadClass("schema $defs chain, deep", "json", schema_defs_chain, 100, 60, _DEPTH),
    PayloadClass("schema $ref chain", "json", schema_ref_chain, MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_DEPTH - 3, _DEPTH),
    PayloadClass("schema $ref graph", "json", schema_ref_graph, 100, 60, _DEPTH),
    PayloadClass("schema many $ref", "json", schema_many_refs, MAX_SCHEMA_REFS + 1, MAX_SCHEMA_REFS - 1,
                 ("$ref", f"limit of {MAX_SCHEMA_REFS:,}")),
    PayloadClass("schema flat $defs", "json", schema_flat_defs, MAX_SCHEMA_DEFS + 1, MAX_SCHEMA_DEFS,
                 ("$defs", f"limit of {MAX_SCHEMA_DEFS}")),
    PayloadClass("schema nested objects", "json", schema_nested_objects, 200, 60, _DEPTH),
    PayloadClass("schema nested arrays", "json", schema_nested_arrays, 300, 120, _DEPTH),
    PayloadClass("schema enum", "json", schema_enum, MAX_ALTERNATIVES + 1, MAX_ALTERNATIVES, ("enum", *_WIDTH)),
    PayloadClass("schema anyOf", "json", schema_any_of, MAX_ALTERNATIVES + 1, MAX_ALTERNATIVES, ("anyOf", *_WIDTH)),
    PayloadClass("regex nesting", "regex", regex_nesting, 1_000, MAX_GRAMMAR_DEPTH - 1, _DEPTH),
    PayloadClass("regex alternation", "regex", regex_alternation, MAX_ALTERNATIVES + 1, MAX_ALTERNATIVES,
                 ("alternatives", *_WIDTH)),
    PayloadClass("choice list", "choice", choice_list, MAX_ALTERNATIVES + 1, MAX_ALTERNATIVES, ("choices", *_WIDTH)),
]

# Over every bound and past llguidance's measured crash (a chain ~2,700 rules or ~930 $defs deep): what
# crashed a process before the bounds, for checks that bypass them
CRASHING = [("grammar", lark_rule_chain(3_000)), ("json", schema_defs_chain(1_000)), ("json", schema_ref_chain(3_000))]
