"""SamplingParams: the sampling knobs of one request, named and defaulted like vLLM's, and the one type
for them from the router to the sampler: the router builds it from the HTTP body, GenerateRequest and
PrefillRequest carry it, the engine's Request holds it. Field types and sizes are wire bounds; every
value range is checked in `_check_ranges`. Either refusal is an InvalidSamplingParams whose message names
the field and the fix, and whose `field` names the field for the router's 400."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from pdserve.control.errors import InvalidSamplingParams
from pdserve.control.schema import MAX_TOKEN_ID, MAX_TOKENS, WireInt, WireModel, max_items, protocol_error

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
MAX_N = 256  # samples of one prompt; the router and LLM fan them out as n requests of n=1 each
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
# Bounds that keep the sampler's float32 arithmetic finite (docs/serving/sampling.md): a temperature or penalty
# beyond them rounds to 0 or inf in float32, or divides logits past float32's range.
MAX_TEMPERATURE = 100.0
# a JSON schema, regex, grammar or choice list of one request (the wire header holds it whole: 1 MiB)
MAX_STRUCTURED_SPEC_CHARS = 1 << 18
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def _one_or_many(value: Any) -> Any:
    """stop="x" means ("x",); None means none (vLLM accepts both)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else value


def _pairs(value: Any) -> Any:
    """logit_bias={token_id: bias} means ((token_id, bias), ...); None means none."""
    if value is None:
        return ()
    return tuple(value.items()) if isinstance(value, dict) else value


StopStrings = Annotated[tuple[str, ...], max_items(MAX_STOP_STRINGS), BeforeValidator(_one_or_many)]
LogitBias = Annotated[tuple[tuple[int, float], ...], max_items(MAX_LOGIT_BIAS), BeforeValidator(_pairs)]
StopTokenIds = Annotated[tuple[int, ...], max_items(MAX_STOP_TOKEN_IDS), BeforeValidator(_one_or_many)]


class SamplingParams(WireModel):
    """Per-request sampling knobs. temperature == 0 means greedy; top_k <= 0, top_p == 1 and min_p == 0
    disable those filters. Lists are frozen into tuples; copy with changes through `replace`.
    stop strings, include_stop_str_in_output, n and skip_special_tokens are the router's (or LLM's): engines
    see token ids only (engine/detokenizer.py applies them, docs/serving/sampling.md)."""

    model_config = ConfigDict(allow_inf_nan=False)  # merged into WireModel's
    type_name: ClassVar[str] = "sampling_params"  # names its fields in errors: "sampling_params.top_k"

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: WireInt | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: StopStrings = ()
    stop_token_ids: StopTokenIds = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a matched stop string (or a stop token's text) stays in the text
    logit_bias: LogitBias = ()  # (token id, bias) pairs: added to those logits before sampling
    # logprobs of each prompt token (and the top-N at its position), computed by whichever engine runs the
    # prompt's forward; a request with it set is never served from the prefix cache (as vLLM)
    prompt_logprobs: int | None = None
    # Structured output (engine/structured_output.py): the output must match one constraint, which both
    # engines of a disaggregated request enforce. kind "json": spec is a JSON schema (JSON text);
    # "json_object": any JSON object (spec empty); "regex"; "grammar": a Lark grammar; "choice": a JSON
    # list of strings, one of which the output is exactly. Built from vLLM's StructuredOutputsParams
    # (`structured_outputs=` to the constructor) or the router's request fields.
    structured_kind: Literal["json", "json_object", "regex", "grammar", "choice"] | None = None
    structured_spec: Annotated[str, Field(max_length=MAX_STRUCTURED_SPEC_CHARS)] = ""

    def __init__(self, /, **fields: Any) -> None:
        if "structured_outputs" in fields:  # vLLM's spelling, offline
            fields.update(structured_fields(fields.pop("structured_outputs")))
        try:  # WireModel.__init__, keeping which field was at fault
            self.__pydantic_validator__.validate_python(fields, self_instance=self)
        except ValidationError as exc:
            error = protocol_error(type(self), exc)
            if isinstance(error, InvalidSamplingParams):  # a range check's own
                raise error from None
            # a wrong type or size, from a caller rather than a peer's header
            loc = exc.errors(include_url=False)[0]["loc"]
            raise InvalidSamplingParams(str(error), field=str(loc[0]) if loc else None) from None

    # As WireModel's: a nested SamplingParams (a peer's header) is validated without this __init__, so a
    # wrong type or size there stays a ProtocolError of the message; its ranges are checked either way.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes`, validated again (model_copy(update=...) would skip validation)."""
        return SamplingParams(**{**self.__dict__, **changes})

    @model_validator(mode="after")
    def _check_ranges(self) -> SamplingParams:
        problem = _range_problem(self)
        if problem is not None:
            field, message = problem
            raise InvalidSamplingParams(message, field=field)
        return self


def _range_problem(p: SamplingParams) -> tuple[str, str] | None:
    """The first value out of its range: (its field, a message naming the fix); None when all are in range.
    Each message is formatted only when its check fails: this runs for every request, on the router and
    again on each engine that receives it."""
    max_tokens, min_tokens = p.max_tokens, p.min_tokens
    if not 1 <= p.n <= MAX_N:
        return "n", f"n={p.n} must be in [1, {MAX_N}]: send several requests for more samples"
    if not p.temperature >= 0:
        return "temperature", f"temperature={p.temperature} must be >= 0 (0 is greedy)"
    if not p.temperature <= MAX_TEMPERATURE:
        return "temperature", (f"temperature={p.temperature} must be at most {MAX_TEMPERATURE:g}: lower it "
                               "(1 is neutral)")
    if not 0 < p.top_p <= 1:
        return "top_p", f"top_p={p.top_p} must be in (0, 1]"
    if not -1 <= p.top_k <= MAX_TOKEN_ID:
        return "top_k", (f"top_k={p.top_k} must be -1 or 0 (disabled) or a positive count up to "
                         f"{MAX_TOKEN_ID}")
    if not 0 <= p.min_p <= 1:
        return "min_p", f"min_p={p.min_p} must be in [0, 1]"
    if not MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY:
        return "repetition_penalty", (f"repetition_penalty={p.repetition_penalty} must be in "
                                      f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables it)")
    if not -2 <= p.presence_penalty <= 2:
        return "presence_penalty", f"presence_penalty={p.presence_penalty} must be in [-2, 2]"
    if not -2 <= p.frequency_penalty <= 2:
        return "frequency_penalty", f"frequency_penalty={p.frequency_penalty} must be in [-2, 2]"
    if not (max_tokens is None or 0 < max_tokens <= MAX_TOKENS):
        return "max_tokens", (f"max_tokens={max_tokens} must be a positive number of tokens to generate, "
                              f"at most {MAX_TOKENS}")
    if not 0 <= min_tokens <= MAX_TOKENS:
        return "min_tokens", f"min_tokens={min_tokens} must be in [0, {MAX_TOKENS}]"
    if not (max_tokens is None or min_tokens <= max_tokens):
        return "min_tokens", f"min_tokens={min_tokens} must not exceed max_tokens={max_tokens}"
    if not all(0 <= t <= MAX_TOKEN_ID for t in p.stop_token_ids):
        bad = next(t for t in p.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID)
        return "stop_token_ids", f"stop_token_ids holds {bad}, which is no token id: ids are in [0, {MAX_TOKEN_ID}]"
    for token_id, bias in p.logit_bias:
        if not 0 <= token_id <= MAX_TOKEN_ID:
            return "logit_bias", f"logit_bias holds {token_id}, which is no token id: ids are in [0, {MAX_TOKEN_ID}]"
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            return "logit_bias", (f"logit_bias of token {token_id} is {bias:g}: a bias must be in "
                                  f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
    if len({token_id for token_id, _ in p.logit_bias}) != len(p.logit_bias):
        return "logit_bias", "logit_bias names a token id twice: give each token one bias"
    if not (p.logprobs is None or 0 <= p.logprobs <= MAX_TOP_LOGPROBS):
        return "logprobs", f"logprobs={p.logprobs} must be in [0, {MAX_TOP_LOGPROBS}]"
    if p.structured_kind is None and p.structured_spec:
        return "structured_spec", "structured_spec is set without structured_kind: name the kind of constraint"
    if p.structured_kind not in (None, "json_object") and not p.structured_spec:
        return "structured_spec", f"structured output of kind {p.structured_kind!r} needs its spec: it is empty"
    if not (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS):
        return "prompt_logprobs", f"prompt_logprobs={p.prompt_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]"
    return None


def structured_fields(params: Any) -> dict[str, Any]:
    """SamplingParams' structured_kind and structured_spec from a StructuredOutputsParams (or None)."""
    if params is None:
        return {"structured_kind": None, "structured_spec": ""}
    if not isinstance(params, StructuredOutputsParams):
        raise InvalidSamplingParams(f"structured_outputs is a {type(params).__name__}: pass a "
                                    "StructuredOutputsParams(json=..., regex=..., choice=..., grammar=... or "
                                    "json_object=True)", field="structured_outputs")
    return params.wire_fields()


class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams, offline: exactly one of json (a JSON schema, as a dict or JSON
    text), regex, choice (a list of strings), grammar (a Lark grammar) or json_object=True."""

    def __init__(self, *, json: dict | str | None = None, regex: str | None = None, choice: list[str] | None = None,
                 grammar: str | None = None, json_object: bool | None = None) -> None:
        given = {name: value for name, value in [("json", json), ("regex", regex), ("choice", choice),
                                                 ("grammar", grammar), ("json_object", json_object or None)]
                 if value is not None}
        if len(given) != 1:
            raise InvalidSamplingParams(f"StructuredOutputsParams takes exactly one constraint, got "
                                        f"{sorted(given) or 'none'}: pass one of json, regex, choice, grammar, "
                                        "json_object", field="structured_outputs")
        (self.kind, self.value), = given.items()

    def wire_fields(self) -> dict[str, Any]:
        if self.kind == "json_object":
            return {"structured_kind": "json_object", "structured_spec": ""}
        if self.kind == "json":
            spec = self.value if isinstance(self.value, str) else json.dumps(self.value)
        elif self.kind == "choice":
            if not (isinstance(self.value, (list, tuple)) and self.value
                    and all(isinstance(c, str) for c in self.value)):
                raise InvalidSamplingParams("choice must be a non-empty list of strings", field="structured_outputs")
            spec = json.dumps(list(self.value))
        else:
            spec = self.value
        return {"structured_kind": self.kind, "structured_spec": spec}
