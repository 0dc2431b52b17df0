"""The operator's chat template (`--chat-template`, vLLM's flag): read from a file or given inline, checked at
start, and used instead of the model's, e.g. for a model that has none (an outside probe: such a model's chat
requests were told to "give a chat_template", which the server refuses unless --allow-request-chat-template)."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.cli import build_parser
from pdserve.router.errors import InvalidRequest
from pdserve.router.schemas import ChatCompletionRequest
from pdserve.router.tokenization import Tokenization
from pdserve.router_cli import read_chat_template, router_config
from pdserve.up import router_component

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi there."}])


@pytest.fixture
def templateless_model(model_factory, tmp_path):
    """A copy of the tiny model without a chat template."""
    model = tmp_path / "model"
    shutil.copytree(model_factory(), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return str(model)


def test_a_model_without_a_template_names_the_flag(templateless_model):
    with pytest.raises(InvalidRequest, match="the server's --chat-template FILE"):
        Tokenization(templateless_model).chat_prompt(CHAT)


def test_the_operators_template_renders_the_chat(templateless_model, tmp_path):
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    args = build_parser().parse_args(["router", "--model", templateless_model, "--chat-template", str(template_file),
                                      "--insecure"])
    config = router_config(args)
    assert config.chat_template == TEMPLATE
    text, token_ids = Tokenization(config.model, config.chat_template).chat_prompt(CHAT)
    assert text == "[user] Hi there.\n[assistant] "
    assert token_ids and Tokenization(templateless_model).decode(token_ids) == text


def test_a_template_replaces_the_models_own(model_factory):
    text, _ = Tokenization(model_factory(), TEMPLATE).chat_prompt(CHAT)
    assert text == "[user] Hi there.\n[assistant] "


def test_up_hands_the_flag_to_its_router(tmp_path):
    args = build_parser().parse_args(["up", "--chat-template", "/srv/chat.jinja", "--insecure"])
    command = router_component(args, "m", "m").command
    assert command[command.index("--chat-template") + 1] == "/srv/chat.jinja"


def test_inline_templates_and_bad_ones(tmp_path):
    assert read_chat_template(TEMPLATE) == TEMPLATE  # braces: the template itself
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file: give a Jinja template file, or the template itself"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="not a Jinja template .*line 1.*fix the template"):
        read_chat_template(str(broken))
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match="cannot read it"):
        read_chat_template(str(binary))
