"""The bounds on what a structured-output constraint may ask of llguidance's compiler: rules, depth
(nesting and reference chains), JSON-schema definitions and references, alternation width. Checked in
pure Python on the constraint's text before anything compiles it; a constraint over a bound is an
InvalidRequestError that names the bound. Why these numbers: docs/serving/security.md."""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.control.errors import InvalidRequestError

MAX_GRAMMAR_RULES = 1_000  # rules and terminals of one Lark grammar
MAX_GRAMMAR_DEPTH = 256  # nesting levels, following rule references and $ref chains
MAX_SCHEMA_DEFS = 500  # entries of $defs / definitions, all levels together
MAX_SCHEMA_REFS = 2_000  # $ref occurrences in one JSON schema
MAX_ALTERNATIVES = 4_096  # choices, enum values, anyOf / oneOf branches, `|` alternatives of one rule or regex


class GrammarLimitError(InvalidRequestError):
    """A constraint over one of the bounds above."""


def check_bounds(kind: str, spec: str) -> None:
    """Raise GrammarLimitError when the constraint (SamplingParams.structured_kind / structured_spec) is
    over a bound. Malformed text passes: the compiler names that problem itself."""
    if kind == "json":
        schema = _loaded(spec, "JSON schema")
        if isinstance(schema, dict):
            SchemaBounds(schema).check()
    elif kind == "choice":
        choices = _loaded(spec, "choice list")
        if isinstance(choices, list):
            _check_width(len(choices), "choice list", "choices")
    elif kind == "regex":
        check_regex(spec, "regex")
    elif kind == "grammar":
        LarkBounds(spec).check()


def _over(what: str, count: int, limit: int, fix: str) -> GrammarLimitError:
    return GrammarLimitError(f"the structured output's {what} is {count:,}, over the limit of {limit:,}: {fix}")


def _check_width(count: int, where: str, unit: str) -> None:
    if count > MAX_ALTERNATIVES:
        raise _over(f"{where}'s number of {unit}", count, MAX_ALTERNATIVES, "send fewer alternatives")


def _check_depth(level: int, where: str) -> None:
    if level > MAX_GRAMMAR_DEPTH:
        raise _too_deep(where)


def _too_deep(where: str) -> GrammarLimitError:
    return GrammarLimitError(f"the structured output's {where} nests deeper than the limit of {MAX_GRAMMAR_DEPTH:,} "
                             "levels (counting the levels its references lead to): send a flatter constraint, with "
                             "shorter chains of references")


def _loaded(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except RecursionError:
        raise _too_deep(what) from None
    except ValueError:
        return None


def check_regex(pattern: str, where: str) -> None:
    """Alternatives and group nesting of a regular expression (escapes and classes skipped)."""
    depth = widest = 0
    alternatives = [1]  # per open group
    for token in re.finditer(r"\\.|\[(?:\\.|[^\]\\])*\]|[()|]", pattern):
        text = token.group()
        if text == "(":
            depth += 1
            alternatives.append(1)
            _check_depth(depth, where)
        elif text == ")" and depth:
            depth -= 1
            widest = max(widest, alternatives.pop())
        elif text == "|":
            alternatives[-1] += 1
    _check_width(max([widest, *alternatives]), where, "alternatives")


class SchemaBounds:
    """One JSON schema's definitions, references and depth; the depth follows $ref (each target counted
    once: a recursive schema is a cycle, not an endless chain)."""

    def __init__(self, schema: dict) -> None:
        self.root = schema
        self.num_defs = 0
        self.num_refs = 0
        self._depths: dict[int, int] = {}  # id(schema node) -> levels at and below it
        self._open: set[int] = set()  # nodes on the current path

    def check(self) -> None:
        self._depth(self.root, 1)

    def _depth(self, node: Any, level: int) -> int:
        """Levels below and at `node`, first reached `level` deep; raises as soon as a bound is passed."""
        _check_depth(level, "JSON schema")
        if isinstance(node, list):
            return max((self._depth(item, level + 1) for item in node), default=0)
        if not isinstance(node, dict) or id(node) in self._open:
            return 0
        known = self._depths.get(id(node))
        if known is not None:
            _check_depth(level + known - 1, "JSON schema")
            return known
        self._count(node)
        self._open.add(id(node))
        below = max((self._depth(value, level + 1) for value in node.values() if isinstance(value, (dict, list))),
                    default=0)
        target = self._target(node.get("$ref"))
        if target is not None:
            below = max(below, self._depth(target, level + 1))
        self._open.discard(id(node))
        self._depths[id(node)] = below + 1
        return below + 1

    def _count(self, node: dict) -> None:
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                self.num_defs += len(node[key])
        if self.num_defs > MAX_SCHEMA_DEFS:
            raise _over("JSON schema's number of $defs / definitions", self.num_defs, MAX_SCHEMA_DEFS,
                        "send a schema with fewer definitions")
        if "$ref" in node:
            self.num_refs += 1
            if self.num_refs > MAX_SCHEMA_REFS:
                raise _over("JSON schema's number of $ref", self.num_refs, MAX_SCHEMA_REFS,
                            "send a schema with fewer references")
        for key in ("enum", "anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                _check_width(len(node[key]), "JSON schema", f"{key} entries")

    def _target(self, ref: Any) -> Any:
        """The node a local reference ("#/$defs/a", "#") points to; None for any other."""
        if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
            return None
        node: Any = self.root
        for part in ref[2:].split("/") if len(ref) > 1 else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


# Lark text: strings, regexes, comments, %json blocks' openings, names, and the punctuation that matters
_LARK_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[imslux]*|//[^\n]*|%json\s*\{|'
                         r"[A-Za-z_][A-Za-z0-9_]*|\n|[()|]")
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:",
                              re.MULTILINE)


class LarkBounds:
    """One Lark grammar's rules (and terminals), the longest chain of references between them (with the
    nesting of parentheses inside each), and its widest alternation."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.bodies: dict[str, list[str]] = {}  # rule -> names it refers to
        self.nesting: dict[str, int] = {}  # rule -> deepest parentheses in its body
        self._depths: dict[str, int] = {}
        self._open: set[str] = set()

    def check(self) -> None:
        starts = [(m.start(), m.end(), m.group(1)) for m in _LARK_DEFINITION.finditer(self.text)]
        if len(starts) > MAX_GRAMMAR_RULES:
            raise _over("Lark grammar's number of rules and terminals", len(starts), MAX_GRAMMAR_RULES,
                        "send a grammar with fewer rules")
        for i, (_, body_start, name) in enumerate(starts):
            body_end = starts[i + 1][0] if i + 1 < len(starts) else len(self.text)
            self._read_rule(name, body_start, body_end)
        for name in self.bodies:
            self._depth(name, 1)

    def _read_rule(self, name: str, start: int, end: int) -> None:
        names, depth, deepest, alternatives = [], 0, 0, [1]
        position = start
        while position < end:
            token = _LARK_TOKEN.search(self.text, position, end)
            if token is None:
                break
            text, position = token.group(), token.end()
            if text.startswith("%json"):
                position = self._embedded_schema(token.end() - 1, end)
            elif text == "(":
                depth += 1
                deepest = max(deepest, depth)
                alternatives.append(1)
                _check_depth(depth, "Lark grammar")
            elif text == ")" and depth:
                depth -= 1
                _check_width(alternatives.pop(), "Lark grammar", "alternatives of one group")
            elif text == "|":
                alternatives[-1] += 1
            elif text[0].isalpha() or text[0] == "_":
                names.append(text)
            elif text[0] == "/" and not text.startswith("//"):
                check_regex(text, "Lark grammar")
        _check_width(max(alternatives), "Lark grammar", "alternatives of one rule")
        self.bodies.setdefault(name, []).extend(names)
        self.nesting[name] = max(self.nesting.get(name, 0), deepest)

    def _embedded_schema(self, brace: int, end: int) -> int:
        """Check the JSON schema of a `%json { ... }` at `brace`; the position after its closing brace."""
        decoder = json.JSONDecoder()
        try:
            schema, after = decoder.raw_decode(self.text[brace:end])
        except RecursionError:
            raise _too_deep("Lark grammar's %json") from None
        except ValueError:
            return brace + 1
        if isinstance(schema, dict):
            SchemaBounds(schema).check()
        return brace + after

    def _depth(self, name: str, level: int) -> int:
        """Levels of the rule `name` and the rules below it, reached `level` deep."""
        _check_depth(level + self.nesting.get(name, 0), "Lark grammar")
        if name not in self.bodies or name in self._open:
            return 0
        known = self._depths.get(name)
        if known is not None:
            _check_depth(level + known - 1, "Lark grammar")
            return known
        self._open.add(name)
        inner = self.nesting[name]
        below = max((self._depth(ref, level + 1 + inner) for ref in self.bodies[name]), default=0)
        self._open.discard(name)
        self._depths[name] = below + 1 + inner
        return self._depths[name]
