"""A conversation in OpenAI's message format -> the prompt text the model's chat template makes of it, for the
offline `LLM.chat` (the router renders its requests the same way: router/tokenization.py). Torch-free."""

from __future__ import annotations

from typing import Any

from pdserve.control.errors import InvalidRequestError

Conversation = list[dict[str, Any]]


def is_conversation(value: Any) -> bool:
    """One conversation (a list of message dicts), rather than a list of conversations."""
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def render_chat(tokenizer, conversation: Conversation, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template applied to the messages; text content parts are joined by newlines, as the router does."""
    if not conversation:
        raise InvalidRequestError("the conversation is empty: send at least one message")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: pass "
                                  "add_generation_prompt=False to continue the last message")
    if tokenizer.chat_template is None and chat_template is None:
        raise InvalidRequestError("this model has no chat template: use generate() with a plain prompt, or pass "
                                  "chat_template")
    messages = [_message(m, index) for index, m in enumerate(conversation)]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, **(chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many kinds for a bad conversation
        raise InvalidRequestError(f"the chat template cannot render this conversation: {exc}") from exc


def _message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequestError(f"message {index} is not a dict with a 'role' (and 'content'): send messages as "
                                  'OpenAI does, e.g. {"role": "user", "content": "Hello"}')
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") != "text" or "text" not in part for part in content):
            raise InvalidRequestError(f"message {index} has a content part that is not text: the models served are "
                                      "text-only, so send text parts only")
        content = "\n".join(part["text"] for part in content)
    return {**message, "content": content or ""}
