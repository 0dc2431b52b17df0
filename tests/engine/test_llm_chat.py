"""`LLM.chat`, as vLLM's: a conversation (or several) rendered by the model's chat template into the same
prompt the router makes of a chat request, then generated; clear errors for what cannot be rendered."""

from __future__ import annotations

import pytest

from pdserve import LLM, InvalidRequestError, SamplingParams
from pdserve.router.schemas import ChatCompletionRequest
from pdserve.router.tokenization import Tokenization

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory()


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, dtype="float32", num_kv_blocks=128)


def test_a_conversation_is_the_prompt_the_router_makes_of_it(llm, model):
    served_text, served_ids = Tokenization(model).chat_prompt(ChatCompletionRequest(messages=TALK))
    output = llm.chat(TALK, GREEDY)[0]
    assert output.prompt == served_text and output.prompt_token_ids == served_ids
    assert output.outputs[0].token_ids == llm.generate({"prompt_token_ids": served_ids}, GREEDY)[0].outputs[0].token_ids


def test_several_conversations_answer_in_order_and_text_parts_join(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    joined = [{"role": "user", "content": "Name\na colour."}]
    outputs = llm.chat([TALK, parts, joined], GREEDY)
    assert len(outputs) == 3 and outputs[0].prompt_token_ids == llm.chat(TALK, GREEDY)[0].prompt_token_ids
    assert outputs[1].prompt == outputs[2].prompt and outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids


def test_the_responses_apis_text_parts_are_text(llm):
    """input_text / output_text (OpenAI's Responses API, taken in chat by vLLM) and an assistant's refusal part
    render as the same text in a text part; an outside probe got "the models served are text-only" for them."""
    def conversation(user_part: dict, assistant_part: dict) -> list[dict]:
        return [{"role": "user", "content": [user_part]}, {"role": "assistant", "content": [assistant_part]},
                {"role": "user", "content": "Again."}]

    plain = llm.chat(conversation({"type": "text", "text": "Name a colour."}, {"type": "text", "text": "No."}),
                     GREEDY)[0]
    for user_part, assistant_part in (({"type": "input_text", "text": "Name a colour."},
                                       {"type": "output_text", "text": "No."}),
                                      ({"type": "text", "text": "Name a colour."}, {"type": "refusal", "refusal": "No."})):
        assert llm.chat(conversation(user_part, assistant_part), GREEDY)[0].prompt == plain.prompt
    with pytest.raises(InvalidRequestError, match="refusal content part without `refusal`"):
        llm.chat(conversation({"type": "text", "text": "x"}, {"type": "refusal", "text": "No."}), GREEDY)


@pytest.mark.parametrize("conversation, says", [
    ([], "conversation is empty"),
    (["hello"], "is not a dict with a 'role'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text-only"),
])
def test_what_cannot_be_rendered_is_named(llm, conversation, says):
    with pytest.raises(InvalidRequestError, match=says):
        llm.chat(conversation, GREEDY)


def test_continuing_the_last_message_excludes_a_generation_prompt(llm):
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        llm.chat(TALK, GREEDY, continue_final_message=True)
    assert llm.chat(TALK, GREEDY, continue_final_message=True, add_generation_prompt=False)[0].outputs[0].token_ids


def test_use_tqdm_shows_each_prompt_finish_once(llm, capsys):
    """vLLM's generate(..., use_tqdm=...) is taken; the bar counts prompts, a stop string's finish too."""
    text = llm.generate("b", GREEDY)[0].outputs[0].text
    stopped = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[text[:2]])
    capsys.readouterr()
    outputs = llm.generate(["a", "b", "c"], [GREEDY, stopped, GREEDY], use_tqdm=True)
    assert outputs[1].outputs[0].stop_reason == text[:2]
    assert "3/3" in capsys.readouterr().err
    llm.chat(TALK, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_n_samples_of_a_prompt_are_n_seeded_requests(llm):
    """SamplingParams(n=3), as vLLM's LLM takes it: sample i is the request seeded seed + i (the router's rule)."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    first, second = llm.generate(["a", "b"], params)
    assert [c.index for c in first.outputs] == [0, 1, 2] and len(second.outputs) == 3
    for index, completion in enumerate(first.outputs):
        alone = llm.generate("a", params.replace(n=1, seed=11 + index))[0].outputs[0]
        assert completion.token_ids == alone.token_ids and completion.text == alone.text
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "distinct seeds, distinct samples"
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_an_engine_request_samples_once(llm):
    with pytest.raises(InvalidRequestError, match="send n requests of n=1"):
        llm.engine.make_request("r", [5, 6], SamplingParams(n=2))
