"""Tool calling on /v1/chat/completions. tool_choice naming a tool constrains the output to that tool's parameters
schema, tool_choice "required" to a JSON array of calls, each {"name": ..., "parameters": ...}; the constrained
JSON becomes the message's tool_calls (router/responses.py's ToolCallFormatter), with any model. tool_choice
"auto", the default with tools, needs a parser of the model's own tool-call format (--tool-call-parser, as vLLM's
--enable-auto-tool-choice): the output is free, and the parser reads its calls (AutoToolCallFormatter); without
one it is a 400 naming the fix. docs/serving/api.md has the rules."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.router.errors import InvalidRequest
from pdserve.router.hermes_tool_parser import HermesToolParser
from pdserve.router.schemas import ChatCompletionRequest, FunctionDefinition

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a tool that gives no parameters schema
_DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point at
_NO_AUTO = ('tool_choice "auto" needs a parser of this model\'s own tool-call format, and this server was started '
            'without one (operators: --tool-call-parser hermes, for models that write <tool_call>{...}</tool_call> '
            'such as Qwen and Hermes): send tool_choice "required" (the model calls one or more of the tools) or '
            '{"type": "function", "function": {"name": "..."}} (it calls that tool), or drop `tools`')
OUTPUT_PARSERS = {"hermes": HermesToolParser}  # --tool-call-parser's choices (config.TOOL_CALL_PARSERS)
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True)
class ToolCalling:
    """How a request's output becomes tool calls: `named`'s arguments, ("required") an array of calls of
    `functions`, or ("auto", `parser` given) the calls the parser reads in free text; at most one call when not
    `parallel`."""

    functions: tuple[FunctionDefinition, ...]  # the request's tools
    named: FunctionDefinition | None  # the tool each choice calls once; None: tool_choice "required" or "auto"
    parallel: bool = True
    parser: str | None = None  # tool_choice "auto": the server's --tool-call-parser; None: a constrained choice

    @property
    def constrains(self) -> bool:
        """Whether the output is constrained to the calls' JSON ("auto" leaves it free: the parser reads it)."""
        return self.parser is None

    @property
    def choice(self) -> str:
        """The request's tool choice, for messages."""
        if self.named is not None:
            return f"tool_choice naming {self.named.name!r}"
        return 'tool_choice "required"' if self.parser is None else 'tool_choice "auto"'

    def output_parser(self) -> HermesToolParser:
        """A new reader of one choice's free output ("auto"): the request's tools, at most one call when not
        parallel."""
        return OUTPUT_PARSERS[self.parser](frozenset(function.name for function in self.functions),
                                           None if self.parallel else 1)

    @property
    def source(self) -> str:
        """Where the request asked for the constraint, for messages."""
        return f"tools ({self.choice})" if self.named is None else f"the parameters of tool {self.named.name!r}"

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output is constrained to (a 400 for tools whose definitions collide)."""
        if self.named is not None:
            return self.named.parameters if self.named.parameters is not None else ANY_OBJECT
        return calls_schema(self.functions, self.parallel)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The message's tool_calls for a choice's output: the named tool's call with the output as its
        arguments (cut short too); for "required", one call per item, or None when the output is no complete
        array of calls (max_tokens or a stop string cut it short)."""
        if self.named is not None:
            return [tool_call(self.named.name, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not (isinstance(items, list) and items and all(_is_call(item) for item in items)):
            return None
        return [tool_call(item["name"], _compact(item["parameters"])) for item in items]


def tool_calling(request: ChatCompletionRequest, parser: str | None = None) -> ToolCalling | None:
    """The request's tool calling, or None (no tools, or tool_choice "none"); a 400 naming the fix for what
    this server cannot serve. `parser`: the server's --tool-call-parser, which serves "auto". Cheap for a
    request without tools."""
    extra = request.model_extra
    if extra and extra.get("functions") and extra.get("function_call") != "none":
        raise InvalidRequest("the legacy `functions` field is not supported: send the functions as `tools` "
                             '([{"type": "function", "function": {...}}]) with tool_choice "required" or naming one, '
                             'or send function_call "none"', param="functions")
    choice = request.tool_choice
    if not request.tools:
        if choice in (None, "none", "auto"):
            return None
        raise InvalidRequest("tool_choice asks for a tool call, but the request has no `tools`: send the tools, "
                             "or drop tool_choice", param="tool_choice")
    if choice == "none":
        return None
    functions = tuple(tool.function for tool in request.tools)
    if choice is None or choice == "auto":
        if parser is None:
            raise InvalidRequest(_NO_AUTO, param="tool_choice")
        return ToolCalling(functions, None, request.parallel_tool_calls, parser)
    if choice == "required":
        return ToolCalling(functions, None, request.parallel_tool_calls)
    named = next((function for function in functions if function.name == choice.function.name), None)
    if named is None:
        names = ", ".join(function.name for function in functions[:8])
        raise InvalidRequest(f"tool_choice names the tool {choice.function.name[:64]!r}, which is not among the "
                             f"request's tools ({names}{', ...' if len(functions) > 8 else ''}): name one of them",
                             param="tool_choice")
    return ToolCalling(functions, named)


def with_tags_shown(request: ChatCompletionRequest, tools: ToolCalling | None) -> ChatCompletionRequest:
    """The request as its engines run it. For tool_choice "auto", special tokens stay in the text unless the request
    sets skip_special_tokens itself, as vLLM's hermes parser asks: some tokenizers mark <tool_call> as a special
    token, and the parser must see the tags."""
    if tools is None or tools.constrains or "skip_special_tokens" in request.model_fields_set:
        return request
    return request.model_copy(update={"skip_special_tokens": False})


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template gets them (OpenAI's shape, as given), or None."""
    return [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def calls_schema(functions: tuple[FunctionDefinition, ...], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of at least one call (at most one unless parallel), each
    {"name": <one tool's name>, "parameters": <its arguments>}. The tools' "$defs" (and "definitions") move to
    the root, where their "$ref"s ("#/$defs/...") point."""
    definitions: dict[str, dict[str, tuple[str, Any]]] = {key: {} for key in _DEFINITION_KEYS}
    items = [_call_schema(function, definitions) for function in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    for key, named in definitions.items():
        if named:
            schema[key] = {name: value for name, (_, value) in named.items()}
    return schema


def _call_schema(function: FunctionDefinition, definitions: dict[str, dict[str, tuple[str, Any]]]) -> dict[str, Any]:
    parameters = dict(function.parameters) if function.parameters is not None else ANY_OBJECT
    for key in _DEFINITION_KEYS:
        if isinstance(parameters.get(key), dict):
            _hoist(function.name, key, parameters.pop(key), definitions[key])
    return {"type": "object", "properties": {"name": {"const": function.name}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def _hoist(owner: str, key: str, found: dict[str, Any], hoisted: dict[str, tuple[str, Any]]) -> None:
    """One tool's definitions into the root's (owner: the tool, for the 400 when two tools differ on one)."""
    for name, value in found.items():
        earlier = hoisted.setdefault(name, (owner, value))
        if earlier[1] != value:
            raise InvalidRequest(f"tools {earlier[0]!r} and {owner!r} both define {key}.{name[:64]}, differently: "
                                 f'with tool_choice "required" their definitions share one schema, so rename one',
                                 param="tools")


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
