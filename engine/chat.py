"""A conversation in OpenAI's message format -> the prompt text the model's chat template makes of it. The one
implementation behind the router's chat requests (router/tokenization.py) and the offline `LLM.chat`. Torch-free.
A conversation it cannot render raises InvalidRequestError, its `field` naming the request field at fault.
Tool loops render: an assistant message's tool_calls (their JSON-text arguments as objects, as chat templates
expect them) and tool messages; tools given go to the template, which shows them if it knows how."""

from __future__ import annotations

import json
from typing import Any

from pdserve.control.errors import InvalidRequestError

Conversation = list[dict[str, Any]]


def is_conversation(value: Any) -> bool:
    """One conversation (a list of message dicts), rather than a list of conversations."""
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def render_chat(tokenizer, conversation: Conversation, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                **template_kwargs: Any) -> str:
    """The chat template (the model's, or template_kwargs["chat_template"]) applied to the messages; text content
    parts are joined by newlines. tools: OpenAI's tool definitions, for the template. template_kwargs: the
    template's variables."""
    if not conversation:
        raise _refused("the conversation is empty: send at least one message", "messages")
    if continue_final_message and add_generation_prompt:
        raise _refused("continue_final_message and add_generation_prompt cannot both be true: set "
                       "add_generation_prompt to false to continue the last message", "continue_final_message")
    if tokenizer.chat_template is None and template_kwargs.get("chat_template") is None:
        raise _refused("this model has no chat template: send a plain prompt instead (/v1/completions, or "
                       "LLM.generate), or give one (the server's --chat-template FILE; LLM.chat's chat_template)",
                       "messages")
    messages = [template_message(message, index) for index, message in enumerate(conversation)]
    if tools:
        template_kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many kinds for a bad conversation
        raise _refused(f"the chat template cannot render these messages: {exc}", "messages") from exc


def template_message(message: Any, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: fields that are None dropped, content one string."""
    if not isinstance(message, dict) or "role" not in message:
        raise _refused(f"messages[{index}] is not a dict with a 'role' (and 'content'): send messages as "
                       'OpenAI does, e.g. {"role": "user", "content": "Hello"}', "messages")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(part, index) for part in content)
    rendered = {**{key: value for key, value in message.items() if value is not None}, "content": content or ""}
    if isinstance(rendered.get("tool_calls"), list):
        rendered["tool_calls"] = [_template_call(call) for call in rendered["tool_calls"]]
    return rendered


def _template_call(call: Any) -> Any:
    """An assistant's tool call with its arguments (OpenAI's JSON text) as the object templates expect
    (`arguments | tojson`); arguments that are no JSON object stay as they are."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    except RecursionError:  # Python's JSON reader stops near 1,000 levels
        raise _refused("a tool call's `arguments` nest too deeply to read: send arguments nested at most a few "
                       "hundred levels", "messages") from None
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


# content part types that hold text, and the key of their text: OpenAI's chat parts, its Responses API's
# input_text / output_text (which vLLM takes in chat too), and an assistant's refusal
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _part_text(part: Any, index: int) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise _refused(f"messages[{index}] has a {kind!r} content part: the models served are text-only, so send "
                       f"parts of the text types only ({', '.join(TEXT_PARTS)})", "messages")
    if not isinstance(part.get(key), str):
        raise _refused(f"messages[{index}] has a {kind} content part without `{key}`: give each such part its "
                       f'text, as {{"type": "{kind}", "{key}": "..."}}', "messages")
    return part[key]


def _refused(message: str, field: str) -> InvalidRequestError:
    error = InvalidRequestError(message)
    error.field = field
    return error
