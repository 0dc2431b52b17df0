"""The model's tokenizer and chat template (transformers), and prompts -> token ids. These calls are
slow for large inputs: the API runs them on preprocess.py's threads, never on the event loop."""

from __future__ import annotations

import inspect
from typing import Any

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import SamplingParams
from pdserve.engine.chat import render_chat
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.errors import InvalidRequest
from pdserve.router.prompt_bound import PromptBound
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.template_sandbox import TemplateSandbox
from pdserve.router.tool_calls import template_tools


class Tokenization:
    def __init__(self, model: str, chat_template: str | None = None) -> None:
        self.tokenizer = load_tokenizer(model)
        if chat_template is not None:  # the operator's (--chat-template) replaces the model's, as vLLM's does
            self.tokenizer.chat_template = chat_template
        # apply_chat_template's own parameters (tokenize, return_tensors, ...): not template variables
        signature = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        self.renderer_params = {p.name for p in signature if p.kind is not p.VAR_KEYWORD} - {"conversation"}
        self.prompt_bound = PromptBound.of(self.tokenizer)  # None: every prompt is tokenized to be measured

    # ---- prompts ----

    def completion_prompts(self, request: CompletionRequest,
                           max_model_len: int | None = None) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt of a completion request (a string, token ids, or a batch).
        A text prompt that cannot fit max_model_len tokens is refused before it is tokenized."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return [self._text_prompt(prompt, max_model_len)]
        if not prompt:
            raise InvalidRequest("prompt is an empty list: send a string, a list of token ids, or a batch of them",
                                 param="prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        for text in prompt:
            if isinstance(text, str):
                self.check_fits(text, max_model_len, "prompt")
        return [self._text_prompt(p) if isinstance(p, str) else (None, list(p)) for p in prompt]

    def _text_prompt(self, text: str, max_model_len: int | None = None) -> tuple[str, list[int]]:
        self.check_fits(text, max_model_len, "prompt")
        return text, self.tokenizer.encode(text)

    def check_fits(self, text: str, max_model_len: int | None, param: str) -> None:
        """A 400 for a text too long to fit max_model_len tokens, told from its length alone (prompt_bound.py)."""
        if max_model_len is None or self.prompt_bound is None:
            return
        min_tokens = self.prompt_bound.min_tokens(text)
        if min_tokens >= max_model_len:
            bound = self.prompt_bound
            raise InvalidRequest(
                f"the prompt has at least {min_tokens} tokens (its {len(text)} characters, where one token of this "
                f"model covers at most {bound.max_token_len} {bound.unit()}), but the model's context length is "
                f"{max_model_len} tokens: shorten the prompt", param=param)

    def chat_prompt(self, request: ChatCompletionRequest, template_sandbox: TemplateSandbox | None = None,
                    max_model_len: int | None = None) -> tuple[str, list[int]]:
        """The chat template applied to the messages (and the request's tools, for templates that show them),
        then tokenized (the template adds the special tokens); a rendered prompt that cannot fit
        max_model_len tokens is refused before it is tokenized. A template in the request is allowed only with
        a template_sandbox, and rendered in it. The request's tool choice is checked before
        (router/tool_calls.py)."""
        conversation = [message.model_dump(exclude_none=True) for message in request.messages]
        options = dict(add_generation_prompt=request.add_generation_prompt,
                       continue_final_message=request.continue_final_message, tools=template_tools(request),
                       **self.template_kwargs(request, template_sandbox is not None))
        try:
            if "chat_template" in options:
                text = template_sandbox.render(conversation, **options)
            else:
                text = render_chat(self.tokenizer, conversation, **options)
        except InvalidRequestError as exc:
            raise InvalidRequest(str(exc), param=exc.field) from exc
        self.check_fits(text, max_model_len, "messages")
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def template_kwargs(self, request: ChatCompletionRequest, allow_template: bool) -> dict[str, Any]:
        """chat_template_kwargs as template variables (data only), plus a request-supplied template
        when the operator allows them: a template is code, and one can hold the CPU for minutes."""
        kwargs = dict(request.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None) or request.chat_template
        reserved = sorted(set(kwargs) & self.renderer_params)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: they are parameters of "
                                 "the renderer, not template variables; drop them", param="chat_template_kwargs")
        if template is not None and not allow_template:
            raise InvalidRequest("a chat_template in the request is not allowed on this server: drop it to use the "
                                 "model's template (operators: --allow-request-chat-template)", param="chat_template")
        return kwargs if template is None else {**kwargs, "chat_template": template}

    # ---- output ----

    def detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer.for_params(self.tokenizer, prompt_token_ids, params)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a piece of a multi-byte character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
