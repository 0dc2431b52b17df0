"""A request's structured output -> the one constraint its engines enforce (SamplingParams.structured_kind
and structured_spec). Asked for by OpenAI's response_format, vLLM's structured_outputs, or vLLM's older
guided_json / guided_regex / guided_choice / guided_grammar, or by tools with tool_choice "required" or naming
a tool (router/tool_calls.py; tool_choice "auto" constrains nothing); one constraint per request. The router
checks it against the grammar bounds and compiles it in a worker process (engine/grammar.py check_isolated)
before any engine sees the request, logging who sent it first; each engine checks it again."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import MAX_STRUCTURED_SPEC_CHARS
from pdserve.engine.grammar import check_isolated
from pdserve.router.errors import InvalidRequest
from pdserve.router.preprocess import Preprocessor, PreprocessTimeout
from pdserve.router.schemas import ONE_STRUCTURED_OUTPUT, SamplingRequest
from pdserve.router.tool_calls import ToolCalling

# vLLM's older fields: field -> the kind of constraint it asks for
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}

log = logging.getLogger("pdserve.router.structured_output")


@dataclass(frozen=True)
class Constraint:
    kind: str  # SamplingParams.structured_kind
    spec: str  # SamplingParams.structured_spec
    source: str  # where the request asked for it, for messages: "structured_outputs.regex"
    field: str | None = None  # the request's field, when not the first part of source ("tools")

    @property
    def param(self) -> str:
        """The request's field at fault in a 400: "response_format", "structured_outputs", "guided_regex"."""
        return self.field or self.source.split(".")[0]

    def sampling_fields(self) -> dict[str, str]:
        return {"structured_kind": self.kind, "structured_spec": self.spec}


def asked_constraint(request: SamplingRequest, tools: ToolCalling | None = None) -> Constraint | None:
    """The request's one constraint (`tools`: its tool calling, when it has one), or None; a 400 for two, or for
    a spec over the wire's bound."""
    tools = _constraining(tools)
    asked = _asked(request, tools)
    if not asked:
        return None
    if len(asked) > 1 and tools is not None:
        other = asked[0]
        raise InvalidRequest(f"{other.source} and tools ({tools.choice}) both constrain the output: the tool choice "
                             "makes the output the tool calls' JSON, so the request takes no other structured output: "
                             f'drop {other.param}, or set tool_choice to "none"', param=other.param)
    if len(asked) > 1:
        sources = " and ".join(constraint.source for constraint in asked[:2])
        raise InvalidRequest(f"the request asks for {len(asked)} structured outputs ({sources}): a request takes "
                             "one constraint, so send only one of them", param=asked[0].param)
    constraint, = asked
    if len(constraint.spec) > MAX_STRUCTURED_SPEC_CHARS:
        raise InvalidRequest(f"{constraint.source} is {len(constraint.spec)} characters as JSON text, over the "
                             f"limit of {MAX_STRUCTURED_SPEC_CHARS}: send a smaller constraint", param=constraint.param)
    return constraint


def check_constraint(constraint: Constraint, origin: str = "a client") -> None:
    """The engines' check of the constraint (within the bounds? does it compile, in a worker process?), as
    a 400 naming the request's field; `origin` (who sent it) is logged before anything compiles it."""
    log.info("request from %s: checking its structured output (%s, %s, %d characters)", origin,
             constraint.source, constraint.kind, len(constraint.spec))
    try:
        check_isolated(constraint.kind, constraint.spec)
    except InvalidRequestError as exc:
        log.info("request from %s: its structured output (%s) is refused: %s", origin, constraint.source, exc)
        raise InvalidRequest(f"{constraint.source}: {exc}", param=constraint.param) from None


def origin_of(http_request: Any) -> str:
    """Who sent a request, for the log: its client address, and its X-Request-Id when it has one."""
    client = http_request.client
    address = f"{client.host}:{client.port}" if client is not None else "an unknown address"
    request_id = http_request.headers.get("x-request-id")
    return f"{address} (x-request-id {request_id[:64]!r})" if request_id else address


async def checked_constraint(request: SamplingRequest, preprocessor: Preprocessor,
                             tools: ToolCalling | None = None, origin: str = "a client") -> Constraint | None:
    """The request's constraint (`tools`: its tool calling, when it has one), checked, or None. Off the event
    loop, on a preprocessing thread: a schema of megabytes takes a while to write as text and to compile, and
    the compile in a worker process is waited for there."""
    tools = _constraining(tools)
    if tools is None and not _asks(request):
        return None
    try:
        return await preprocessor.run(_checked, request, tools, origin)
    except PreprocessTimeout:
        raise PreprocessTimeout(f"checking the request's structured output took longer than the server's limit of "
                                f"{preprocessor.timeout_s:g}s: send a smaller constraint (operators: "
                                "--preprocess-timeout)") from None


def _constraining(tools: ToolCalling | None) -> ToolCalling | None:
    """The tool calling, when it constrains the output (tool_choice "auto" does not: any constraint of the
    request's own, such as structured_outputs, is then its one)."""
    return tools if tools is not None and tools.constrains else None


def _asks(request: SamplingRequest) -> bool:
    """Whether the request asks for a constraint at all (cheap: every request passes here)."""
    return ((request.response_format is not None and request.response_format.type != "text")
            or request.structured_outputs is not None or request.guided_json is not None
            or request.guided_regex is not None or request.guided_choice is not None
            or request.guided_grammar is not None)


def _checked(request: SamplingRequest, tools: ToolCalling | None, origin: str) -> Constraint | None:
    constraint = asked_constraint(request, tools)
    if constraint is not None:
        check_constraint(constraint, origin)
    return constraint


def _asked(request: SamplingRequest, tools: ToolCalling | None) -> list[Constraint]:
    """Every constraint the request asks for, in the order of its fields, its tool calling's last."""
    asked = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(Constraint("json_object", "", "response_format"))
    elif response_format is not None and response_format.type == "json_schema":
        asked.append(Constraint("json", _json_text(response_format.json_schema.schema_), "response_format"))
    if request.structured_outputs is not None:
        asked += _structured_outputs(request.structured_outputs)
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value is not None:
            asked.append(Constraint(kind, _spec_text(kind, value), field))
    if tools is not None:
        asked.append(Constraint("json", _json_text(tools.schema()), tools.source, "tools"))
    return asked


def _structured_outputs(params: Any) -> list[Constraint]:
    """vLLM's structured_outputs object (schemas.StructuredOutputs): the constraints it names, at least one."""
    given = {"json": params.json_, "regex": params.regex, "choice": params.choice, "grammar": params.grammar,
             "json_object": params.json_object or None}
    asked = [Constraint(kind, _spec_text(kind, value), f"structured_outputs.{kind}")
             for kind, value in given.items() if value is not None]
    if not asked:
        raise InvalidRequest(f"structured_outputs names no constraint: {ONE_STRUCTURED_OUTPUT}, or drop it",
                             param="structured_outputs")
    return asked


def _spec_text(kind: str, value: Any) -> str:
    """SamplingParams.structured_spec of a constraint's value: a schema or choice list as JSON text."""
    if kind == "json_object":
        return ""
    if kind == "choice" or (kind == "json" and not isinstance(value, str)):
        return _json_text(value)
    return value


def _json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # ASCII: as many bytes on the wire as characters
