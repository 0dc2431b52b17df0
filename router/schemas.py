"""Request bodies of the OpenAI API (plus vLLM's extensions), validated by pydantic.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; a field of the wrong type
or out of range is a 400 that names it (api.py turns pydantic's errors into OpenAI's shape).
specs.py builds each choice's SamplingParams from these once; the limits both know are its.
"""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdserve.control.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

INT64 = 1 << 63
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat's is the rest of the context)


_CONTAINERS = frozenset((str, dict, list))


def unencodable_path(value: Any, path: str = "body") -> str | None:
    """Where a JSON value holds text UTF-8 cannot encode (a lone UTF-16 surrogate such as \\ud800)."""
    if isinstance(value, str):
        return None if value.isascii() or _encodable(value) else path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and not _CONTAINERS.isdisjoint(map(type, value)):  # not token ids only
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and not (key.isascii() or _encodable(key)):
            return path
        if isinstance(item, (str, dict, list)):
            found = unencodable_path(item, f"{path}.{key}")
            if found:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@functools.cache
def _fields_with_a_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that are optional with a default other than None."""
    return frozenset(name for name, field in model.model_fields.items()
                     if not field.is_required() and field.default is not None)


def refused(param: str | None, message: str) -> PydanticCustomError:
    """A refusal raised by a model validator, whose location is the whole body: the error carries the field at
    fault (ctx "param"), which api.py puts in the 400's `param`."""
    return PydanticCustomError("refused", "{message}", {"message": message, "param": param})


def _without_defaulted_nulls(model: type[BaseModel], data: Any) -> Any:
    """data less its explicit nulls in fields that have a default: null means "use the default", as in OpenAI's
    API (its optional fields are "or null") and vLLM; clients that write every field send them. Required fields
    and fields whose default is None are left alone."""
    if not isinstance(data, dict) or None not in data.values():
        return data
    defaulted = _fields_with_a_default(model)
    return {key: value for key, value in data.items() if value is not None or key not in defaulted}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far; it implies include_usage unless that is sent as false (vLLM's
    # include_usage defaults to true)
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return _without_defaulted_nulls(cls, data)

    @property
    def usage_included(self) -> bool:
        return self.include_usage or (self.continuous_usage_stats and "include_usage" not in self.model_fields_set)


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: `name` required as OpenAI requires it; `strict` taken, with no
    meaning beyond the schema's own (the output always fits the schema)."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # "schema" would shadow BaseModel.schema
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object), or "json_schema"."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('a response_format of type "json_schema" needs its schema: send {"type": "json_schema", '
                             '"json_schema": {"name": "...", "schema": {...}}}, or {"type": "json_object"} for any '
                             "JSON object")
        return self


# vLLM's structured_outputs: the constraints (one of them), and options it takes that change nothing here
_STRUCTURED_OUTPUT_KEYS = frozenset(("json", "regex", "choice", "grammar", "json_object", "disable_fallback",
                                     "disable_any_whitespace"))
ONE_STRUCTURED_OUTPUT = "send one of json, regex, choice, grammar or json_object: true"  # for messages


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (extra_body): one of json (a schema, as an object or JSON text), regex,
    choice, grammar (Lark) or json_object=true. Other keys would change the answer and are refused."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # "json" would shadow BaseModel.json
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    # no fallback backend to disable, and JSON never has free whitespace here
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        unknown = sorted(set(data) - _STRUCTURED_OUTPUT_KEYS) if isinstance(data, dict) else []
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0][:40]} is not served: {ONE_STRUCTURED_OUTPUT}")
        return data


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # the JSON parser takes NaN and Infinity

    model: str | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # token id (as JSON keys are) -> bias
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each prompt token's, and the top-N
    # structured output (router/structured_output.py): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* spellings of the same constraints
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return _without_defaulted_nulls(cls, data)

    # vLLM fields that would change the answer and that this server does not serve: refused rather than ignored
    unserved_fields: ClassVar[dict[str, str]] = {
        "guided_whitespace_pattern": "JSON output is always compact here: drop guided_whitespace_pattern",
    }

    @model_validator(mode="before")
    @classmethod
    def _no_unserved_field(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, fix in cls.unserved_fields.items():
                if data.get(name) not in (None, False):
                    raise refused(name, f"{name} is not served: {fix}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        path = unencodable_path(data)
        if path is not None:
            path = path.removeprefix("body.")
            raise refused(None if path == "body" else path.split(".")[0],
                          f"{path} holds text that is not valid Unicode (a lone UTF-16 surrogate such as \\ud800): "
                          "send well-formed text, with characters outside the BMP as surrogate pairs")
        return data

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):  # as OpenAI answers it
            raise ValueError("stream_options is only allowed when stream is true: drop it or set stream=true")
        return value

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.usage_included)

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=0)  # 0 only with echo: the prompt alone (specs.py)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def has_text_prompt(self) -> bool:
        """A prompt to tokenize (a string, or a batch of strings), rather than token ids only. A validated
        list holds one kind of item (the union's members), so its first item tells (no walk over every id)."""
        prompt = self.prompt
        return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))

    def num_prompts(self) -> int:
        """Prompts in the request, counted without tokenizing: a string or one list of ids is one prompt."""
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """A call an assistant message made (OpenAI's tool_calls[i].function): arguments as JSON text."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI sends it; some clients send the object


class ToolCall(BaseModel):
    """One of an assistant message's tool_calls, as OpenAI clients send them back in a tool loop."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (content null)
    tool_call_id: str | None = None  # a tool message: the call it answers


# OpenAI's rule for a function's name, and its limit on tools per request
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    """A tool's function: `parameters` is its arguments' JSON schema (absent: any JSON object); `strict` is
    taken, with no meaning beyond the schema's own (a constrained call always fits it)."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _openai_name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(f"the tool name {name[:80]!r} breaks OpenAI's rule: 1 to 64 letters, digits, "
                             "underscores or dashes; rename the tool")
        return name


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one tool: {"type": "function", "function": {"name": "..."}}."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    unserved_fields: ClassVar[dict[str, str]] = {
        **SamplingRequest.unserved_fields,
        "echo": "chat answers never repeat the conversation here: drop echo (or use /v1/completions' echo)",
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # tool calling (router/tool_calls.py): a named tool or "required" constrain the output; "auto" needs the
    # router's --tool-call-parser (else a 400)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True
    # vLLM's extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless the operator allows it (tokenization.py)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        named = isinstance(value, dict) and value.get("type") == "function"
        if value is None or named or value in ("none", "auto", "required"):
            return value
        raise ValueError(f"tool_choice {str(value)[:80]!r} is not served: send \"none\", \"auto\", \"required\" "
                         'or {"type": "function", "function": {"name": "..."}}')

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for tool in tools or ():
            if tool.function.name in seen:
                raise ValueError(f"two tools are named {tool.function.name!r}: give each tool its own name")
            seen.add(tool.function.name)
        return tools

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
