"""The sampler: greedy, temperature, filters, seeds, penalties, min_tokens, logprobs, batches."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.layers.sampler import Sampler, apply_logits_processors, seeded_uniform
from pdserve.engine.request import Request, SamplingParams


def make_request(prompt=(0,), output=(), eos=None, request_id="r", **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_id=eos)
    for token_id in output:
        request.append_output_token(token_id)
    return request


def frequencies(token_ids: list[int], vocab_size: int) -> torch.Tensor:  # [vocab_size]
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).float() / len(token_ids)


def reference_allowed(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Plain-Python filter pipeline for one row: {token: renormalised probability} it keeps."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = [t for t in order if probs[t] >= min_p * probs[order[0]]]
    if top_k > 0:
        kept = kept[:top_k]
    mass = sum(probs[t] for t in kept)
    nucleus, mass_before = [], 0.0
    for t in kept:
        if mass_before >= top_p * mass:
            break
        nucleus.append(t)
        mass_before += probs[t]
    nucleus_mass = sum(probs[t] for t in nucleus)
    return {t: probs[t] / nucleus_mass for t in nucleus}


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_returns_the_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 50).to(dtype)
    requests = [make_request(temperature=0.0) for _ in range(6)]
    out = Sampler()(logits, requests)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("vocab", [8 * 1024, 49152, 50000, 151936])  # whole chunks, and a tail past the last one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_of_a_large_vocabulary_equal_torch_argmax(vocab, dtype):
    """The chunked argmax: the first maximum wins, within a chunk, across chunks and in the tail; NaN counts as the
    largest (the first NaN)."""
    from pdserve.engine.layers.sampler import greedy_tokens

    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab).to(dtype)
    logits[0, [5, 900]] = 50.0  # a tie inside the first chunk
    logits[1, [100, vocab - 1]] = 50.0  # a tie between a chunk and the tail (or the last chunk)
    logits[2, vocab - 1] = 60.0  # the maximum in the last position
    logits[3, [2000, 7000]] = float("nan")
    logits[4, vocab - 2] = float("nan")  # a NaN only in the tail
    logits[5] = -1.0  # every position equal: the first
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits[:, :4000]), logits[:, :4000].argmax(dim=-1))  # small: argmax itself


def test_greedy_breaks_ties_to_the_lowest_id_on_both_paths():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0]])
    plain = make_request(temperature=0.0)
    penalized = make_request(prompt=[3], temperature=0.0, repetition_penalty=1.5)  # slow path
    assert Sampler()(logits, [plain, penalized]).token_ids == [1, 1]


def test_a_tiny_temperature_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(20, 30)
    requests = [make_request(temperature=1e-7) for _ in range(20)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 100)
    requests = [make_request(temperature=1.3, top_k=1) for _ in range(16)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- distributions


ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
NUM_DRAWS = 4000


def test_temperature_frequencies_match_softmax():
    torch.manual_seed(0)
    requests = [make_request(temperature=0.7) for _ in range(NUM_DRAWS)]
    out = Sampler()(ROW.expand(NUM_DRAWS, -1), requests)
    expected = torch.softmax(ROW / 0.7, dim=-1)
    assert (frequencies(out.token_ids, len(ROW)) - expected).abs().max() < 0.03


def test_seeded_rows_follow_the_distribution_too():
    requests = [make_request(temperature=1.0, seed=seed) for seed in range(NUM_DRAWS)]
    out = Sampler()(ROW.expand(NUM_DRAWS, -1), requests)
    expected = torch.softmax(ROW, dim=-1)
    assert (frequencies(out.token_ids, len(ROW)) - expected).abs().max() < 0.03


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.8, top_p=0.6),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=1.0, top_k=6, min_p=0.3),
        dict(temperature=1.2, top_k=5, top_p=0.8, min_p=0.1),
    ],
    ids=["top_k", "top_p", "min_p", "min_p_below_top_k", "all"],
)
def test_filters_keep_exactly_the_allowed_tokens_with_renormalised_frequencies(params):
    torch.manual_seed(2)
    allowed = reference_allowed(ROW, **params)
    requests = [make_request(**params) for _ in range(NUM_DRAWS)]
    out = Sampler()(ROW.expand(NUM_DRAWS, -1), requests)
    assert set(out.token_ids) == set(allowed), "a filtered-out token was drawn, or a kept one never"
    expected = torch.zeros(len(ROW))
    for token_id, prob in allowed.items():
        expected[token_id] = prob
    assert (frequencies(out.token_ids, len(ROW)) - expected).abs().max() < 0.03


def test_draws_across_many_vocab_blocks_follow_the_distribution():
    # 2500 tokens span three blocks of the two-level draw, the last one padded.
    torch.manual_seed(8)
    vocab_size, num_draws = 2500, 3000
    row = torch.full((vocab_size,), -10.0)
    hot_ids = [0, 1023, 1024, 2047, 2499]
    row[hot_ids] = torch.tensor([1.0, 0.5, 0.0, 1.5, 0.8])
    requests = [make_request(temperature=1.0) for _ in range(num_draws)]
    out = Sampler()(row.expand(num_draws, -1), requests)
    observed = frequencies(out.token_ids, vocab_size)
    expected = torch.softmax(row, dim=-1)
    assert (observed[hot_ids] - expected[hot_ids]).abs().max() < 0.035
    cold = torch.ones(vocab_size, dtype=torch.bool)
    cold[hot_ids] = False
    assert abs(observed[cold].sum() - expected[cold].sum()) < 0.01


def test_top_p_on_a_flat_large_vocab_stays_in_the_nucleus():
    # A flat row needs many redraws before a token lands in the nucleus.
    torch.manual_seed(3)
    row = torch.randn(2000) * 0.5
    allowed = reference_allowed(row, top_p=0.3)
    requests = [make_request(temperature=1.0, top_p=0.3) for _ in range(64)]
    out = Sampler()(row.expand(64, -1), requests)
    assert set(out.token_ids) <= set(allowed)
    assert len(set(out.token_ids)) > 10


# --------------------------------------------------------------------------- seeds


def test_a_seeded_token_ignores_the_batch_the_row_and_the_global_rng():
    torch.manual_seed(4)
    vocab_size = 2500  # several blocks of the two-level draw
    row = torch.randn(vocab_size)
    params = dict(temperature=1.0, top_p=0.9, top_k=100, seed=1234)

    def target():  # a fresh Request each time, as another process would build it
        return make_request(prompt=[1, 2], output=[5, 6, 7], request_id="seeded", **params)

    alone = Sampler()(row[None], [target()]).token_ids[0]
    for position, batch_size in [(0, 5), (3, 5), (6, 7)]:
        torch.manual_seed(100 + position)
        logits = torch.randn(batch_size, vocab_size) * 2
        logits[position] = row
        requests = [
            make_request(temperature=0.9, top_p=0.5),
            make_request(temperature=0.0),
            make_request(temperature=1.1, seed=9, presence_penalty=0.5, output=[1]),
            make_request(temperature=0.6, top_k=20, min_p=0.05),
            make_request(temperature=1.0),
            make_request(temperature=0.0, logprobs=2),
            make_request(temperature=1.0, top_k=2000),
        ][:batch_size]
        requests[position] = target()
        assert Sampler()(logits, requests).token_ids[position] == alone


def test_seeded_tokens_change_with_the_seed_and_with_the_step():
    row = torch.zeros(1, 50)
    by_seed = set()
    for seed in range(20):
        by_seed.add(Sampler()(row, [make_request(temperature=1.0, seed=seed)]).token_ids[0])
    request = make_request(temperature=1.0, seed=7)
    by_step = set()
    for _ in range(20):
        token_id = Sampler()(row, [request]).token_ids[0]
        by_step.add(token_id)
        request.append_output_token(token_id)
    assert len(by_seed) > 5 and len(by_step) > 5


def test_seeded_uniform_is_in_range_and_spread():
    values = [seeded_uniform(seed, step) for seed in range(100) for step in range(100)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    assert len(set(values)) == len(values)
    assert seeded_uniform(-5, 3) == seeded_uniform(-5, 3) != seeded_uniform(-5, 3, draw_round=1)


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_covers_prompt_and_output_tokens():
    logits = torch.tensor([[1.0, 2.0, -1.0, -4.0, 0.5]])
    request = make_request(prompt=[1, 3], output=[3], repetition_penalty=2.0)
    processed = apply_logits_processors(logits.clone(), [request])
    assert processed.tolist() == [[1.0, 1.0, -1.0, -8.0, 0.5]]


def test_presence_and_frequency_penalties_cover_output_tokens_only():
    logits = torch.ones(1, 5)
    request = make_request(
        prompt=[0], output=[2, 2, 4], presence_penalty=0.5, frequency_penalty=0.25
    )
    processed = apply_logits_processors(logits, [request])
    # token 2: 1 - (2 * 0.25 + 0.5); token 4: 1 - (0.25 + 0.5); token 0 is only in the prompt.
    assert processed.tolist() == [[1.0, 1.0, 0.0, 1.0, 0.25]]


def test_penalties_apply_per_row_in_order():
    logits = torch.tensor([[3.0, -2.0, 1.0], [3.0, -2.0, 1.0], [3.0, -2.0, 1.0]])
    requests = [
        make_request(output=[0, 1], repetition_penalty=2.0, presence_penalty=1.0),
        make_request(output=[0, 1]),  # no penalties: untouched
        make_request(prompt=[2], output=[1, 1], frequency_penalty=-1.0),
    ]
    processed = apply_logits_processors(logits.clone(), requests)
    assert processed.tolist() == [
        [3.0 / 2 - 1.0, -2.0 * 2 - 1.0, 1.0],
        [3.0, -2.0, 1.0],
        [3.0, -2.0 + 2.0, 1.0],
    ]


def test_penalties_steer_greedy_requests():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    request = make_request(output=[0], temperature=0.0, presence_penalty=0.5)
    assert Sampler()(logits, [request]).token_ids == [1]


# --------------------------------------------------------------------------- logit_bias


def test_logit_bias_adds_to_its_tokens_in_its_row_only():
    biased = make_request(logit_bias={1: 2.5, 3: -100.0})
    plain = make_request(request_id="p")
    processed = apply_logits_processors(torch.ones(2, 4), [biased, plain])
    assert processed.tolist() == [[1.0, 3.5, 1.0, -99.0], [1.0] * 4]


def test_logit_bias_steers_greedy_and_leaves_logprobs_raw():
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    forced = make_request(temperature=0.0, logit_bias={2: 100.0}, logprobs=0)
    output = Sampler()(logits, [forced])
    assert output.token_ids == [2]
    assert output.logprobs[0][2] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())  # OpenAI: raw
    banned = make_request(temperature=0.0, logit_bias={0: -100.0})
    assert Sampler()(logits, [banned]).token_ids == [1]


def test_min_tokens_outranks_a_positive_bias():
    request = make_request(eos=2, min_tokens=1, temperature=0.0, logit_bias={2: 100.0})
    assert Sampler()(torch.zeros(1, 4), [request]).token_ids != [2]


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    request = make_request(eos=4, min_tokens=2, stop_token_ids=[2, 99])
    processed = apply_logits_processors(torch.zeros(1, 6), [request])
    inf = math.inf
    assert processed.tolist() == [[0.0, 0.0, -inf, 0.0, -inf, 0.0]]
    request.append_output_token(0)
    request.append_output_token(1)
    assert apply_logits_processors(torch.zeros(1, 6), [request]).tolist() == [[0.0] * 6]


def test_min_tokens_leaves_eos_alone_when_ignore_eos():
    request = make_request(eos=4, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    processed = apply_logits_processors(torch.zeros(1, 6), [request])
    assert processed[0].isinf().nonzero().flatten().tolist() == [2]


def test_min_tokens_holds_back_a_greedy_eos():
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0]])
    request = make_request(eos=3, min_tokens=1, temperature=0.0)
    assert Sampler()(logits, [request]).token_ids == [1]
    request.append_output_token(1)
    assert Sampler()(logits, [request]).token_ids == [3]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_hold_the_sampled_and_top_tokens_of_the_raw_logits():
    torch.manual_seed(5)
    logits = torch.randn(3, 40).to(torch.bfloat16)
    requests = [
        make_request(output=[7], temperature=0.5, repetition_penalty=1.3, logprobs=3),
        make_request(temperature=0.0, logprobs=0),
        make_request(temperature=1.0),
    ]
    out = Sampler()(logits, requests)
    raw = torch.log_softmax(logits.float(), dim=-1)

    top3 = raw[0].topk(3)
    first = out.logprobs[0]
    assert out.token_ids[0] in first
    assert set(top3.indices.tolist()) <= set(first) and len(first) <= 4
    for token_id, logprob in first.items():
        assert logprob == pytest.approx(raw[0, token_id].item(), abs=1e-6)
    ranked = [first[t] for t in top3.indices.tolist()]
    assert ranked == sorted(ranked, reverse=True)

    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(raw[1].max().item(), abs=1e-6)}
    assert out.logprobs[2] is None


# --------------------------------------------------------------------------- batches and errors


def test_a_mixed_batch_matches_each_row_sampled_alone():
    torch.manual_seed(6)
    logits = torch.randn(5, 64) * 2
    requests = [
        make_request(temperature=0.0),
        make_request(output=[int(logits[1].argmax())], temperature=0.0, frequency_penalty=2.0),
        make_request(temperature=0.8, top_k=1),
        make_request(output=[3], temperature=0.9, top_p=0.7, seed=42),
        make_request(temperature=1.0, top_p=0.9, min_p=0.05),
    ]
    out = Sampler()(logits, requests)
    processed = apply_logits_processors(logits.clone(), requests)
    assert out.token_ids[:3] == processed[:3].argmax(dim=-1).tolist()
    assert out.token_ids[3] == Sampler()(logits[3:4], [requests[3]]).token_ids[0]
    assert out.token_ids[4] in reference_allowed(logits[4], top_p=0.9, min_p=0.05)
    assert out.token_ids[1] != logits[1].argmax().item()


def test_the_callers_logits_are_not_modified():
    torch.manual_seed(7)
    logits = torch.randn(2, 20)
    before = logits.clone()
    requests = [
        make_request(prompt=[1, 2], output=[3], repetition_penalty=1.5, presence_penalty=1.0),
        make_request(eos=5, min_tokens=3, temperature=0.7, top_k=5, top_p=0.5, min_p=0.1),
    ]
    Sampler()(logits, requests)
    assert torch.equal(logits, before)
    unpenalized = [make_request(temperature=0.5, top_k=3, min_p=0.2), make_request(top_p=0.4)]
    Sampler()(logits, unpenalized)  # no penalties: the sampler works on the caller's tensor
    assert torch.equal(logits, before)


def test_an_empty_batch_gives_an_empty_output():
    out = Sampler()(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []


def test_logits_that_do_not_fit_the_requests_are_refused():
    with pytest.raises(ValueError, match="do not fit 2 requests"):
        Sampler()(torch.zeros(3, 10), [make_request(), make_request()])
    with pytest.raises(ValueError, match="floating-point"):
        Sampler()(torch.zeros(1, 10, dtype=torch.long), [make_request()])


def test_a_token_outside_the_vocabulary_names_the_request():
    request = make_request(prompt=[1, 12], request_id="bad-prompt", repetition_penalty=1.2)
    with pytest.raises(ValueError, match="'bad-prompt'.*token id 12"):
        Sampler()(torch.zeros(1, 10), [request])


def test_nan_logits_in_a_sampled_row_are_an_error():
    logits = torch.zeros(1, 10)
    logits[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        Sampler()(logits, [make_request(temperature=1.0)])
