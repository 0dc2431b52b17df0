"""Validated API requests -> ChoiceSpecs the engines can run: token limits against the context
length, one SamplingParams per prompt (the engines get it as it is; what the request leaves unset
comes from the model's generation_config.json, as in vLLM), n x prompts fan-out (prompt logprobs asked
of sample 0 only). Everything refused here is a 400 that names the fix."""

from __future__ import annotations

from typing import Any

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import SamplingParams
from pdserve.engine.generation_defaults import GenerationDefaults
from pdserve.router.errors import InvalidRequest
from pdserve.router.choice import ChoiceSpec, SharedPromptLogprobs
from pdserve.router.schemas import COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, SamplingRequest
from pdserve.router.structured_output import Constraint


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int, param: str,
                       default: int | None = None, requested_as: str = "max_tokens") -> int:
    """max_tokens for the engine: as asked; when not given, the default (the model's max_new_tokens)
    within the rest of the context, or the rest of the context. requested_as: the request's field that asked
    (chat's max_completion_tokens, when given)."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(f"the prompt has {num_prompt_tokens} tokens but the model's context length is "
                             f"{max_model_len} tokens, which leaves no room to generate: shorten the prompt",
                             param=param)
    if requested is None:
        return min(default or max_model_len, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + requested > max_model_len:
        raise InvalidRequest(f"the model's context length is {max_model_len} tokens, but the prompt has "
                             f"{num_prompt_tokens} tokens and {requested_as} asks for {requested} more: shorten the "
                             f"prompt or lower {requested_as} to at most {max_model_len - num_prompt_tokens}",
                             param=requested_as)
    return requested


def check_token_ids(token_ids: list[int], vocab_size: int | None, param: str) -> None:
    if not token_ids:
        raise InvalidRequest("the prompt is empty: send at least one token", param=param)
    if vocab_size is None:
        return
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab_size})", param=param)


def sampling_params(request: SamplingRequest, max_tokens: int, logprobs: int | None,
                    defaults: GenerationDefaults = GenerationDefaults(), vocab_size: int | None = None,
                    prompt_logprobs: int | None = None, constraint: Constraint | None = None) -> SamplingParams:
    """The request's SamplingParams, the model's defaults where the request is silent, with its structured
    output's `constraint` (router/structured_output.py): its checks (e.g. min_tokens <= max_tokens, at most
    16 stop strings) refuse it here, as a 400 naming the request's parameter in the request's words, rather
    than on an engine."""
    sampling = defaults.fill(
        {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
         "repetition_penalty": request.repetition_penalty}, request.model_fields_set)
    logit_bias = logit_bias_of(request, vocab_size)
    try:
        return SamplingParams(
            **sampling, min_p=request.min_p, seed=request.seed,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop_strings(),
            stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=logit_bias, prompt_logprobs=prompt_logprobs,
            **(constraint.sampling_fields() if constraint is not None else {}))
    except InvalidRequestError as exc:
        # in the request's words: no "sampling_params." prefix, and a chat request's max_completion_tokens
        message, param = str(exc).replace(f"{SamplingParams.type_name}.", ""), exc.field
        if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
            message = message.replace("max_tokens=", "max_completion_tokens=")
            param = "max_completion_tokens" if param == "max_tokens" else param
        raise InvalidRequest(message, param=param) from exc


def check_n(request: SamplingRequest, num_prompts: int, max_n: int) -> None:
    check_choices(request.n, num_prompts, max_n)


def check_choices(n: int, num_prompts: int, max_n: int) -> None:
    if n * num_prompts > max_n:
        raise InvalidRequest(f"n={n} x {num_prompts} prompt(s) asks for {n * num_prompts} "
                             f"choices, over this server's limit of {max_n}: send several requests",
                             param="n")


def check_raw_choices(body: Any, max_n: int) -> None:
    """check_n on a completion request's parsed JSON, before it is validated: a batch of 650,000 prompts is
    refused without building (and validating) a model of each. What is not a batch is left to validation."""
    if not isinstance(body, dict):
        return
    prompt, n = body.get("prompt"), body.get("n")
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return  # a string, or one prompt of token ids
    check_choices(n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1, len(prompt), max_n)


def _as_token_id(key: str) -> int | None:
    try:
        token_id = int(key) if key.isascii() else -1
    except ValueError:  # not a number, or 4300+ digits
        return None
    return token_id if token_id >= 0 else None


def logit_bias_of(request: SamplingRequest, vocab_size: int | None) -> dict[int, float]:
    """The request's logit_bias with token ids as ints ({"50256": -100} in JSON), within the vocabulary."""
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        token_id = _as_token_id(key)
        if token_id is None:
            raise InvalidRequest(f"logit_bias key {key[:40]!r} is not a token id: key the biases by token ids, "
                                 'e.g. {"50256": -100}', param="logit_bias")
        if vocab_size is not None and token_id >= vocab_size:
            raise InvalidRequest(f"logit_bias names token id {token_id}, outside the model's vocabulary "
                                 f"[0, {vocab_size})", param="logit_bias")
        bias[token_id] = value
    return bias


def check_prompt_logprobs(request: SamplingRequest) -> None:
    if request.stream and request.prompt_logprobs is not None:  # as vLLM refuses it
        raise InvalidRequest("prompt_logprobs are not available when stream is enabled: drop prompt_logprobs "
                             "or set stream to false", param="prompt_logprobs")


def _specs(request: SamplingRequest, prompts: list[list[int]], params_of: list[SamplingParams],
           prompt_only: bool = False) -> list[ChoiceSpec]:
    """n choices per prompt: sample i seeded seed + i; only sample 0 asks the engines for prompt logprobs,
    and the prompt's other samples report its set (SharedPromptLogprobs)."""
    specs = []
    for prompt_index, (token_ids, params) in enumerate(zip(prompts, params_of)):
        asks_prompt_logprobs = params.prompt_logprobs is not None
        shared = SharedPromptLogprobs() if asks_prompt_logprobs and request.n > 1 else None
        for sample in range(request.n):
            changes = {}
            if params.seed is not None and sample:  # distinct samples, still reproducible
                changes["seed"] = (params.seed + sample) % (1 << 63)
            if asks_prompt_logprobs and sample:  # computed once per prompt
                changes["prompt_logprobs"] = None
            sample_params = params.replace(**changes) if changes else params
            specs.append(ChoiceSpec(prompt_index * request.n + sample, token_ids, sample_params, prompt_only, shared))
    return specs


def _completion_max_tokens(request: CompletionRequest, defaults: GenerationDefaults) -> tuple[int | None, int | None]:
    """(max_tokens asked, default when not asked) for resolve_max_tokens. An unset max_tokens is the API's
    default of 16, or the model's max_new_tokens if that is smaller (as vLLM); max_tokens=0 with echo (the
    prompt alone, vLLM's echo without generation) runs as one token, which the router drops."""
    if "max_tokens" not in request.model_fields_set or request.max_tokens is None:
        return None, min(COMPLETION_MAX_TOKENS, defaults.max_tokens or COMPLETION_MAX_TOKENS)
    if request.max_tokens > 0:
        return request.max_tokens, None
    if not request.echo:
        raise InvalidRequest("max_tokens=0 generates nothing: ask for at least 1 token, or set echo=true to get "
                             "the prompt alone (with its logprobs if logprobs is set)", param="max_tokens")
    if request.min_tokens > 0:
        raise InvalidRequest(f"min_tokens={request.min_tokens} must not exceed max_tokens=0: drop min_tokens",
                             param="min_tokens")
    return 1, None


def _completion_prompt_logprobs(request: CompletionRequest) -> int | None:
    """The top-N the engines compute per prompt token: echo with logprobs=N shows the prompt's logprobs, and
    prompt_logprobs asks for them in their own field; one computation serves both."""
    asked = [n for n in (request.logprobs if request.echo else None, request.prompt_logprobs) if n is not None]
    return max(asked, default=None)


def completion_specs(request: CompletionRequest, prompts: list[list[int]], max_model_len: int,
                     vocab_size: int | None, max_n: int, defaults: GenerationDefaults = GenerationDefaults(),
                     constraint: Constraint | None = None) -> list[ChoiceSpec]:
    if request.suffix:
        raise InvalidRequest("suffix is not supported: put the text in the prompt", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequest("best_of is not supported: use n to get several completions", param="best_of")
    check_prompt_logprobs(request)
    check_n(request, len(prompts), max_n)
    requested, default = _completion_max_tokens(request, defaults)
    prompt_logprobs = _completion_prompt_logprobs(request)
    params_of = []
    for token_ids in prompts:
        check_token_ids(token_ids, vocab_size, "prompt")
        max_tokens = resolve_max_tokens(len(token_ids), requested, max_model_len, "prompt", default)
        params_of.append(sampling_params(request, max_tokens, request.logprobs, defaults, vocab_size, prompt_logprobs,
                                         constraint))
    return _specs(request, prompts, params_of, prompt_only=request.max_tokens == 0)


def chat_specs(request: ChatCompletionRequest, token_ids: list[int], max_model_len: int,
               max_n: int, defaults: GenerationDefaults = GenerationDefaults(),
               vocab_size: int | None = None, constraint: Constraint | None = None) -> list[ChoiceSpec]:
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    check_prompt_logprobs(request)
    check_n(request, 1, max_n)
    check_token_ids(token_ids, None, "messages")
    requested_as = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(len(token_ids), request.max_new_tokens(), max_model_len, "messages",
                                    defaults.max_tokens, requested_as)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, max_tokens, logprobs, defaults, vocab_size, request.prompt_logprobs, constraint)
    return _specs(request, [token_ids], [params])
