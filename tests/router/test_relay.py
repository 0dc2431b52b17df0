"""The relay's state machine (router/relay.py) without sockets: each transition of docs/design/request-lifecycle.md's
state diagram, fed the (source, item) pairs the links would put in the attempt's inbox."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from pdserve.control.messages import PromptLogprobs, TokenDelta
from pdserve.control.sampling_params import SamplingParams
from pdserve.router.choice import SHARED, ChoiceSpec, SharedPromptLogprobs
from pdserve.router.errors import EngineFailed, InvalidRequest, RequestTimeout
from pdserve.router.link import EngineGone, PromptLogprobsChunk
from pdserve.router.relay import DEADLINE, Migrate, Relay, RelayState, Retry
from tests.router.conftest import REPO

PROMPT = [5, 6, 7, 8]
P, D = "prefill", "decode"
S = RelayState


@dataclass
class FakeLink:
    control_address: str


@dataclass
class FakeRoute:
    decode: FakeLink = field(default_factory=lambda: FakeLink("tcp://d"))
    prefill: FakeLink | None = field(default_factory=lambda: FakeLink("tcp://p"))


@dataclass
class FakeSubmission:
    """What the relay asks of generation.Submission, recorded."""

    route: FakeRoute = field(default_factory=FakeRoute)
    finished: bool = False
    told_first_tokens: list[int] = field(default_factory=list)  # FirstToken sent to D
    num_prefill_releases: int = 0

    def keep_first_token(self, delta: TokenDelta) -> None:
        self.told_first_tokens.append(delta.token_ids[0])

    def release_prefill(self) -> None:
        self.num_prefill_releases += 1
        self.route.prefill = None


class FakeDetokenizer:
    """Each token as "<id>"; a token in `stop_ids` is a stop string's match."""

    def __init__(self, stop_ids: tuple[int, ...] = ()) -> None:
        self.stop_ids, self.stopped_by, self.text = stop_ids, None, ""

    def add_tokens(self, token_ids: list[int], ends_with_stop_token: bool = False) -> None:
        for token_id in token_ids:
            self.text += f"<{token_id}>"
            if token_id in self.stop_ids:
                self.stopped_by = f"<{token_id}>"

    def take_new_text(self, finished: bool) -> str:
        text, self.text = self.text, ""
        return text


def make_relay(prompt_logprobs: int | None = None, shared: SharedPromptLogprobs | None = None,
               stop_ids: tuple[int, ...] = ()) -> tuple[Relay, FakeSubmission]:
    params = SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs)
    spec = ChoiceSpec(index=0, prompt_token_ids=PROMPT, sampling_params=params, shared_prompt_logprobs=shared)
    submission = FakeSubmission()
    return Relay(spec, submission, FakeDetokenizer(stop_ids)), submission


def tokens(*token_ids: int, finish: str | None = None, **fields) -> TokenDelta:
    return TokenDelta(request_id="r", token_ids=token_ids, finish_reason=finish, **fields)


def logprob_chunk() -> PromptLogprobsChunk:
    """The whole prompt's logprobs in one chunk: positions 1..3, the prompt token first."""
    msg = PromptLogprobs(request_id="r", start=1, num_positions=len(PROMPT) - 1, width=1, last=True)
    return PromptLogprobsChunk(msg, [{token_id: (-1.0, 1)} for token_id in PROMPT[1:]])


def relayed_ids(deltas) -> list[int]:
    return [token_id for delta in deltas for token_id in delta.token_ids]


def test_the_first_token_from_p_then_ds_stream_less_its_copy():
    relay, submission = make_relay()
    assert relay.state is S.WAITING_FIRST_TOKEN
    assert relayed_ids(relay.receive(P, tokens(11))) == [11]
    assert relay.state is S.WAITING_DECODE
    assert submission.told_first_tokens == [11] and submission.num_prefill_releases == 1
    assert relayed_ids(relay.receive(D, tokens(11, 12))) == [12], "D's copy of the first token is dropped"
    assert relay.state is S.STREAMING
    assert relay.receive(P, tokens(99)) == [], "P's part is over"
    last = relay.receive(D, tokens(13, finish="length"))
    assert relayed_ids(last) == [13] and last[-1].finish_reason == "length"
    assert relay.state is S.FINISHED and submission.finished
    assert relay.token_ids == [11, 12, 13]
    assert relay.receive(D, tokens(14)) == []


def test_recompute_on_d_its_first_token_comes_first_and_ps_is_not_used():
    relay, submission = make_relay()
    assert relayed_ids(relay.receive(D, tokens(21))) == [21]
    assert relay.state is S.STREAMING
    assert relay.receive(P, tokens(21)) == [] and submission.told_first_tokens == []
    assert relayed_ids(relay.receive(D, tokens(22, finish="stop"))) == [22]
    assert relay.state is S.FINISHED


def test_d_continuing_from_another_token_than_ps_is_an_engine_failure():
    relay, _ = make_relay()
    relay.receive(P, tokens(11))
    with pytest.raises(EngineFailed, match="continued from token 30"):
        relay.receive(D, tokens(30, 31))
    assert relay.state is S.FAILED


def test_a_first_token_that_ends_the_choice_finishes_it_without_telling_d():
    relay, submission = make_relay()
    assert relayed_ids(relay.receive(P, tokens(11, finish="length"))) == [11]
    assert relay.state is S.FINISHED and submission.told_first_tokens == []
    assert not submission.finished, "D did not end the request itself: closing the attempt aborts it"


def test_a_stop_string_in_the_first_token_finishes_the_choice():
    relay, submission = make_relay(stop_ids=(11,))
    delta, = relay.receive(P, tokens(11))
    assert delta.finish_reason == "stop" and delta.stop_reason == "<11>"
    assert relay.state is S.FINISHED and submission.num_prefill_releases == 0


def test_ds_first_token_before_ps_prompt_logprobs_waits_for_them_in_order():
    relay, _ = make_relay(prompt_logprobs=1)
    assert relay.receive(D, tokens(21)) == []
    assert relay.state is S.WAITING_PROMPT_LOGPROBS
    assert relay.receive(D, tokens(22)) == [], "D's later messages wait behind its first token"
    deltas = relay.receive(P, logprob_chunk())
    assert relayed_ids(deltas) == [21, 22] and relay.state is S.STREAMING
    assert deltas[0].prompt_logprobs == [None, {6: (-1.0, 1)}, {7: (-1.0, 1)}, {8: (-1.0, 1)}]
    assert deltas[1].prompt_logprobs is None


def test_ps_prompt_logprobs_before_its_first_token_come_with_it():
    relay, _ = make_relay(prompt_logprobs=1)
    assert relay.receive(P, logprob_chunk()) == [] and relay.state is S.WAITING_FIRST_TOKEN
    delta, = relay.receive(P, tokens(11))
    assert delta.prompt_logprobs[1] == {6: (-1.0, 1)} and relay.state is S.WAITING_DECODE


def test_p_leaving_while_its_prompt_logprobs_are_awaited_retries_with_the_prefill_on_d():
    relay, _ = make_relay(prompt_logprobs=1)
    relay.receive(D, tokens(21))
    with pytest.raises(Retry) as retry:
        relay.receive(P, EngineGone("p0", "missed heartbeats"))
    assert retry.value.force_local and retry.value.exclude == "tcp://p" and relay.state is S.FAILED


def test_ps_token_without_its_prompt_logprobs_is_the_engines_fault():
    relay, _ = make_relay(prompt_logprobs=1)
    relay.receive(D, tokens(21))
    with pytest.raises(EngineFailed, match="before the prompt logprobs"):
        relay.receive(P, tokens(21))


def test_another_sample_takes_sample_0s_prompt_logprobs_once_they_are_set():
    shared = SharedPromptLogprobs()
    relay, _ = make_relay(shared=shared)
    assert relay.waits_for_shared_rows
    assert relay.receive(D, tokens(21)) == [] and relay.state is S.WAITING_PROMPT_LOGPROBS
    rows = [None, {6: (-0.5, 1)}]
    shared.set(rows)
    delta, = relay.receive(SHARED, None)
    assert delta.prompt_logprobs == rows and delta.token_ids == [21] and relay.state is S.STREAMING


def test_sample_0_shares_its_prompt_logprobs():
    shared = SharedPromptLogprobs()
    relay, _ = make_relay(prompt_logprobs=1, shared=shared)
    assert not relay.waits_for_shared_rows
    relay.receive(P, logprob_chunk())
    relay.receive(P, tokens(11))
    assert shared.rows[1] == {6: (-1.0, 1)}


@pytest.mark.parametrize("source, force_local", [(P, True), (D, False)])
def test_an_engine_that_leaves_before_the_first_token_is_a_retry_elsewhere(source, force_local):
    relay, _ = make_relay()
    with pytest.raises(Retry) as retry:
        relay.receive(source, EngineGone("e0", "stopped"))
    assert retry.value.exclude == f"tcp://{source[0]}" and retry.value.force_local is force_local
    assert relay.state is S.FAILED


@pytest.mark.parametrize("source, error_code, expected", [
    (P, None, Retry),
    (D, "invalid_request", InvalidRequest),
    (D, "kv_transfer_failed", EngineFailed),
    (P, "engine_step_failed", EngineFailed),
])
def test_an_engine_error_is_a_retry_or_the_clients_error(source, error_code, expected):
    relay, _ = make_relay()
    with pytest.raises(expected):
        relay.receive(source, tokens(finish="error", error="it broke", error_code=error_code))
    assert relay.state is S.FAILED


def test_the_deadline_ends_the_attempt_in_any_state():
    relay, _ = make_relay()
    relay.receive(P, tokens(11))
    with pytest.raises(RequestTimeout, match="--request-timeout"):
        relay.receive(DEADLINE, None)
    assert relay.state is S.FAILED


def test_d_lost_while_streaming_migrates_and_the_new_attempt_continues_the_same_stream():
    relay, submission = make_relay(stop_ids=(15,))
    relay.receive(D, tokens(21))
    relay.receive(D, tokens(22, 23))
    with pytest.raises(Migrate) as lost:
        relay.receive(D, EngineGone("d0", "missed heartbeats"))
    assert relay.state is S.MIGRATING and lost.value.exclude == "tcp://d"
    assert relay.token_ids == [21, 22, 23], "what the new attempt resumes after"
    resumed = FakeSubmission(route=FakeRoute(decode=FakeLink("tcp://d2"), prefill=None))
    relay.resume(resumed)
    assert relay.state is S.STREAMING and relay.submission is resumed
    assert relayed_ids(relay.receive(D, tokens(24))) == [24], "the new engine's tokens come as they are"
    last = relay.receive(D, tokens(15, 99))
    assert last[-1].finish_reason == "stop" and last[-1].text == "<15>", "the same detokenizer finds the stop"
    assert relay.state is S.FINISHED and relay.token_ids == [21, 22, 23, 24, 15]


def test_d_lost_after_ps_first_token_migrates_with_that_token():
    relay, _ = make_relay()
    relay.receive(P, tokens(11))
    assert relay.state is S.WAITING_DECODE
    with pytest.raises(Migrate):
        relay.receive(D, EngineGone("d0", "its connection dropped"))
    assert relay.state is S.MIGRATING and relay.token_ids == [11]
    relay.resume(FakeSubmission(route=FakeRoute(decode=FakeLink("tcp://d2"), prefill=None)))
    assert relayed_ids(relay.receive(D, tokens(12))) == [12], "D resumes after the first token: nothing dropped"


def test_only_a_migrating_relay_resumes():
    relay, _ = make_relay()
    with pytest.raises(RuntimeError, match="WAITING_FIRST_TOKEN has nothing to resume"):
        relay.resume(FakeSubmission())


def test_an_engine_error_after_tokens_is_not_a_migration():
    relay, _ = make_relay()
    relay.receive(D, tokens(21))
    with pytest.raises(EngineFailed):
        relay.receive(D, tokens(finish="error", error="it broke", error_code="internal_error"))
    assert relay.state is S.FAILED


def test_the_design_docs_state_diagram_names_exactly_the_codes_states():
    text = (REPO / "docs/design/request-lifecycle.md").read_text()
    diagram = text.split("```mermaid\nstateDiagram-v2", 1)[1].split("```", 1)[0]
    assert set(re.findall(r"\b[A-Z][A-Z_]{3,}\b", diagram)) == {state.name for state in RelayState}


def test_a_stop_string_spanning_the_migration_point_is_found(tokenization):
    """The real detokenizer, kept by the relay across a migration: a stop string made of the end of the last
    token before it and the start of the first token after it ends the choice there."""
    vocab = tokenization.tokenizer
    words = [vocab.encode(word, add_special_tokens=False) for word in ("hello", " world", " again")]
    token_ids = [t for ids in words for t in ids]
    cut = len(words[0])  # the lost engine streamed "hello"; the new one goes on with " world again"
    params = SamplingParams(max_tokens=16, stop=["o w"])
    spec = ChoiceSpec(index=0, prompt_token_ids=PROMPT, sampling_params=params)
    relay = Relay(spec, FakeSubmission(), tokenization.detokenizer(PROMPT, params))
    before = [d for t in token_ids[:cut] for d in relay.receive(D, tokens(t))]
    with pytest.raises(Migrate):
        relay.receive(D, EngineGone("d0", "its connection dropped"))
    relay.resume(FakeSubmission(route=FakeRoute(decode=FakeLink("tcp://d2"), prefill=None)))
    after = [d for t in token_ids[cut:] for d in relay.receive(D, tokens(t))]
    assert "".join(d.text for d in before + after) == "hell"
    assert after[-1].finish_reason == "stop" and after[-1].stop_reason == "o w" and relay.state is S.FINISHED
