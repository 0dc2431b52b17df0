"""Prompt logprobs through `pdserve up` as real processes and the real openai client, disaggregated (1P1D: the
prefill engine computes them) and colocated (the decode engine prefills): lm-evaluation-harness's loglikelihood
request (echo with logprobs, max_tokens 1 or 0) against transformers on the same weights, vLLM's prompt_logprobs
on both endpoints, and the stream rules."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import scrape, shared_layout_cluster

# over --max-num-batched-tokens 64 (conftest's ENGINE_ARGS): the prompt is computed in several chunks
LONG_PROMPT = ("import os\nimport sys\n\ndef main(argv):\n    for name in argv[1:]:\n        with open(name) as f:\n"
               "            print(len(f.read().splitlines()), name)\n    return 0\n\nif __name__ == '__main__':\n"
               "    sys.exit(main(sys.argv))\n")
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tiny_model, tmp_path_factory, shared_layouts):
    yield from shared_layout_cluster(request.param, tiny_model, tmp_path_factory, shared_layouts)


class Reference:
    """transformers on the same model directory, float32: log_softmax of the logits at each position."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(self, token_ids: list[int]):
        """[len(token_ids), vocab]: row i is the distribution of the token after position i."""
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([token_ids])).logits[0].float()
        return self.torch.log_softmax(logits, dim=-1)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The logprob of each prompt token after the first, given the tokens before it."""
        rows = self.logprobs(token_ids)
        return [float(rows[p - 1, token_ids[p]]) for p in range(1, len(token_ids))]

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.fixture(scope="module")
def reference(tiny_model) -> Reference:
    return Reference(tiny_model)


def loglikelihood(client, prompt: str, max_tokens: int):
    """lm-evaluation-harness's request for a context and continuation's loglikelihood."""
    return client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                     temperature=0)


def check_prompt_part(logprobs, token_ids: list[int], reference: Reference) -> None:
    """The first len(token_ids) entries of a completion's logprobs against the reference."""
    num = len(token_ids)
    rows = reference.logprobs(token_ids)
    assert logprobs.tokens[:num] == [reference.text(t) for t in token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:num] == pytest.approx(reference.prompt_logprobs(token_ids), abs=TOLERANCE)
    for position in range(1, num):
        top = logprobs.top_logprobs[position]
        likeliest = max(top, key=top.get)
        assert likeliest == reference.text(int(rows[position - 1].argmax())), position
        assert top[likeliest] == pytest.approx(float(rows[position - 1].max()), abs=TOLERANCE)
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1))


def kv_bytes_received(url: str) -> float:
    return sum(scrape(url).get("pdserve_kv_bytes_received_total", {}).values())


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
def test_loglikelihood_requests_match_transformers(client, reference, prompt):
    token_ids = reference.tokenizer.encode(prompt)
    num = len(token_ids)
    one = loglikelihood(client, prompt, max_tokens=1)
    choice = one.choices[0]
    assert choice.text.startswith(prompt) and choice.finish_reason == "length"
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (num, 1)
    assert len(choice.logprobs.tokens) == num + 1
    check_prompt_part(choice.logprobs, token_ids, reference)
    last = reference.logprobs(token_ids)[-1]  # the greedy token after the prompt, and its logprob
    assert choice.logprobs.tokens[num] == reference.text(int(last.argmax()))
    assert choice.logprobs.token_logprobs[num] == pytest.approx(float(last.max()), abs=TOLERANCE)

    none = loglikelihood(client, prompt, max_tokens=0)
    choice = none.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (none.usage.prompt_tokens, none.usage.completion_tokens) == (num, 0)
    assert len(choice.logprobs.tokens) == num
    check_prompt_part(choice.logprobs, token_ids, reference)
    again = loglikelihood(client, prompt, max_tokens=0).choices[0].logprobs
    assert again.token_logprobs == choice.logprobs.token_logprobs, "the same answer again (no prefix-cache hit)"


def check_vllm_prompt_logprobs(field: list, token_ids: list[int], reference: Reference, num_top: int) -> None:
    """vLLM's shape: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...], the prompt token and top-k."""
    rows = reference.logprobs(token_ids)
    assert field[0] is None and len(field) == len(token_ids)
    for position in range(1, len(token_ids)):
        entry, row, token_id = field[position], rows[position - 1], token_ids[position]
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(float(row[token_id]), abs=TOLERANCE)
        assert own["rank"] == int((row > row[token_id]).sum()) + 1, position
        assert {int(k) for k in entry} == {int(i) for i in row.topk(num_top).indices} | {token_id}, position
        tops = [value["rank"] for key, value in entry.items() if key != str(token_id) or own["rank"] <= num_top]
        assert sorted(tops) == list(range(1, num_top + 1)), entry
        for key, value in entry.items():
            assert value["decoded_token"] == reference.text(int(key))
            assert value["logprob"] == pytest.approx(float(row[int(key)]), abs=TOLERANCE)


def test_prompt_logprobs_on_completions(client, reference):
    base = reference.tokenizer.encode(PROMPT)
    greedy = []  # the prompt continued greedily: each of these tokens is the argmax, rank 1
    for _ in range(3):
        greedy.append(int(reference.logprobs(base + greedy)[-1].argmax()))
    token_ids = base + greedy
    response = client.completions.create(model="tiny", prompt=token_ids, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3})
    choice = response.choices[0]
    field = choice.model_extra["prompt_logprobs"]
    check_vllm_prompt_logprobs(field, token_ids, reference, 3)
    assert [field[p][str(t)]["rank"] for p, t in enumerate(greedy, start=len(base))] == [1, 1, 1]
    assert choice.logprobs is None and response.usage.completion_tokens == 2
    plain = client.completions.create(model="tiny", prompt=token_ids, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra, "not asked for: not there"


def test_prompt_logprobs_on_chat_with_several_choices(client, reference):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, n=2,
                                              extra_body={"prompt_logprobs": 3, "return_token_ids": True})
    token_ids = response.model_extra["prompt_token_ids"]
    check_vllm_prompt_logprobs(response.model_extra["prompt_logprobs"], token_ids, reference, 3)
    assert len(response.choices) == 2 and response.usage.prompt_tokens == len(token_ids)
    assert all("prompt_logprobs" not in choice.model_extra for choice in response.choices)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_extra


def test_prompt_logprobs_with_stream_are_refused_by_name(client):
    for create, extra in ((client.completions.create, {"prompt": PROMPT}),
                          (client.chat.completions.create, {"messages": MESSAGES})):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="tiny", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}, **extra)
        error = refused.value.body
        assert error["param"] == "prompt_logprobs" and "stream" in error["message"], error


def test_echo_with_logprobs_streams_the_prompt_first(cluster, client, reference):
    token_ids = reference.tokenizer.encode(PROMPT)
    alone = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                           stream=True))
    assert alone[0].choices[0].text == PROMPT, "the first chunk is the prompt's text"
    check_prompt_part(alone[0].choices[0].logprobs, token_ids, reference)

    received = kv_bytes_received(cluster.url)
    whole = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    check_prompt_part(whole.choices[0].logprobs, token_ids, reference)
    if cluster.layout == "1p1d":  # the prefill engine ran the prompt, its logprobs included; the KV followed
        assert kv_bytes_received(cluster.url) > received
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) >= len(token_ids)
    assert all(not chunk.choices[0].text.startswith(PROMPT) for chunk in chunks[1:])
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    streamed = [t for chunk in chunks for t in chunk.choices[0].logprobs.token_logprobs]
    expected = whole.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and expected[0] is None
    assert streamed[1:] == pytest.approx(expected[1:], abs=TOLERANCE)
