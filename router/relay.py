"""The relay of one attempt of one choice: what its prefill (P) and decode (D) engines send, merged into
the choice's deltas by one object in one explicit state (docs/design/request-lifecycle.md).

    relay = Relay(spec, submission, detokenizer)
    relay.receive(source, item) -> [ChoiceDelta, ...]   # source: "prefill", "decode", SHARED or DEADLINE
    relay.state                                          # a RelayState; FINISHED after the last delta

The first token comes from P as soon as it is sampled, or from D when D prefilled the prompt itself
(recompute); the first one in is the choice's. P's is relayed at once and D is told it (FirstToken): D's
stream then starts with that token again, and it is dropped. When D is lost after tokens were relayed (its
process died, or it stopped beating), the relay raises Migrate and waits in MIGRATING until the runner
`resume`s it on a new attempt, which continues the same tokens and text (router/migration.py). A choice that asked for prompt logprobs
gets them with its first token; when that token overtakes them (they come on P's socket, D's token on
D's), the relay holds D's messages until they are in. `receive` raises what ends the attempt: Retry
(send it again elsewhere), EngineFailed, InvalidRequest or RequestTimeout (the state is then FAILED), or
Migrate (MIGRATING).
"""

from __future__ import annotations

import enum
from typing import Any

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import TokenDelta
from pdserve.control.prompt_logprobs import PromptLogprobsAssembler
from pdserve.router.choice import SHARED, ChoiceDelta, ChoiceSpec, PromptRows
from pdserve.router.errors import EngineFailed, InvalidRequest, RequestTimeout
from pdserve.router.link import EngineGone, PromptLogprobsChunk

DEADLINE = "deadline"  # the source of the item an attempt's timer puts in its inbox


class RelayState(enum.Enum):
    WAITING_FIRST_TOKEN = "waiting_first_token"  # nothing relayed yet: P or D may send the first token
    WAITING_PROMPT_LOGPROBS = "waiting_prompt_logprobs"  # the first token is in before its prompt logprobs: held
    WAITING_DECODE = "waiting_decode"  # P's first token relayed and D told it; D's first token repeats it
    STREAMING = "streaming"  # D's tokens relayed as they come; P's part is over
    MIGRATING = "migrating"  # D was lost after tokens were relayed: the runner resumes them on another engine
    FINISHED = "finished"  # the last delta (with its finish_reason) relayed
    FAILED = "failed"  # receive() raised: the runner retries the choice or reports the error


class Retry(Exception):
    """The attempt failed before anything it relayed could be wrong: send the choice again elsewhere."""

    def __init__(self, reason: str, *, exclude: str | None = None, force_local: bool = False) -> None:
        super().__init__(reason)
        self.exclude = exclude  # the control address of the engine not to route to again
        self.force_local = force_local  # prefill on the decode engine (P failed)


class Migrate(Exception):
    """The decode engine was lost after tokens were relayed: resume the choice on another one."""

    def __init__(self, reason: str, *, exclude: str) -> None:
        super().__init__(reason)
        self.exclude = exclude  # the control address of the engine that was lost


class Relay:
    """One attempt's relay. `submission` (generation.Submission) carries the attempt: its route, FirstToken
    to D (keep_first_token), the end of P's part (release_prefill), and `finished` (D ended the request)."""

    def __init__(self, spec: ChoiceSpec, submission: Any, detokenizer: Any) -> None:
        self.spec = spec
        self.submission = submission
        self.detokenizer = detokenizer
        self.state = RelayState.WAITING_FIRST_TOKEN
        self.token_ids: list[int] = []  # relayed so far
        self.first_token: int | None = None  # P's, relayed: D's first token again
        self.gather = PromptLogprobsGather(spec.prompt_token_ids) if spec.asks_engines_for_prompt_logprobs else None
        self.rows_due = spec.reports_prompt_logprobs  # until the first token, which carries them
        self.rows: PromptRows | None = None  # for the first delta
        self.held: list[tuple[str, Any]] = []  # what came in WAITING_PROMPT_LOGPROBS, in order

    @property
    def waits_for_shared_rows(self) -> bool:
        """A sample other than 0: its prompt logprobs are sample 0's (SHARED tells it they are set)."""
        return self.rows_due and self.gather is None

    def receive(self, source: str, item: Any) -> list[ChoiceDelta]:
        try:
            return self._receive(source, item)
        except Migrate:
            self.state = RelayState.MIGRATING
            raise
        except BaseException:
            self.state = RelayState.FAILED
            raise

    def resume(self, submission: Any) -> None:
        """MIGRATING -> STREAMING: the new attempt's decode engine goes on after `token_ids` (it was sent them
        as resume_token_ids), so its tokens are relayed as they come, through the same detokenizer."""
        if self.state is not RelayState.MIGRATING:
            raise RuntimeError(f"a relay in state {self.state.name} has nothing to resume")
        self.submission = submission
        self.state = RelayState.STREAMING

    def _receive(self, source: str, item: Any) -> list[ChoiceDelta]:
        if source == DEADLINE:
            raise RequestTimeout("the request took longer than the router's request timeout: raise "
                                 "--request-timeout or lower max_tokens")
        if self.state is RelayState.FINISHED or (source == "prefill" and self.state in (
                RelayState.WAITING_DECODE, RelayState.STREAMING)):
            return []  # P's part is over once a first token is relayed
        if self.state is RelayState.WAITING_PROMPT_LOGPROBS:
            return self._while_waiting_for_rows(source, item)
        if source == SHARED:
            return []  # sample 0's rows, set before this sample's first token: read then
        if type(item) is not TokenDelta:
            return self._notice(source, item)
        if item.finish_reason in ("error", "abort"):
            raise engine_failure(source, item)
        if self.state is RelayState.WAITING_FIRST_TOKEN:
            return self._first_token(source, item)
        return self._from_decode(item)

    def _notice(self, source: str, item: Any) -> list[ChoiceDelta]:
        """What a link puts in the inbox besides tokens: an engine that left (retry elsewhere), or a chunk of
        the prompt's logprobs (gathered before the first token; dropped after it)."""
        if isinstance(item, EngineGone):
            if source == "decode" and self.state in (RelayState.WAITING_DECODE, RelayState.STREAMING):
                raise Migrate(f"decode engine {item.engine_id} left ({item.reason}) after {len(self.token_ids)} "
                              "tokens", exclude=self.submission.route.decode.control_address)
            raise Retry(f"{source} engine {item.engine_id} left ({item.reason})",
                        exclude=getattr(self.submission.route, source).control_address,
                        force_local=source == "prefill")
        if isinstance(item, PromptLogprobsChunk) and self.gather is not None and self.rows_due:
            self.gather.add(source, item)
        return []

    def _first_token(self, source: str, delta: TokenDelta) -> list[ChoiceDelta]:
        """WAITING_FIRST_TOKEN: P's first token (D is told it), or D's (it prefilled the prompt itself)."""
        if not (delta.token_ids or delta.finish_reason):
            return self._relayed(source, delta)
        if self.rows_due and not self._take_rows(source):
            self.held.append((source, delta))
            self.state = RelayState.WAITING_PROMPT_LOGPROBS
            return []
        if source == "decode":
            self.state = RelayState.STREAMING
        elif delta.token_ids:
            self.first_token = delta.token_ids[0]
            if delta.finish_reason is None:
                self.submission.keep_first_token(delta)
                self.state = RelayState.WAITING_DECODE
        return self._relayed(source, delta)

    def _take_rows(self, source: str) -> bool:
        """The prompt logprobs at the first token, if they are all in: P's or D's set (then shared with the
        prompt's other samples), or sample 0's for another sample. False: they are still on their way."""
        shared = self.spec.shared_prompt_logprobs
        if self.gather is None:
            if shared.rows is None:
                return False
            self.rows = shared.rows
        elif not self.gather.complete and source == "decode" and self.submission.route.prefill is not None:
            return False  # P's set is sent before the KV D's token needed, but on another socket
        else:
            self.rows = self.gather.result(source)
            if shared is not None:
                shared.set(self.rows)
        self.rows_due = False
        return True

    def _while_waiting_for_rows(self, source: str, item: Any) -> list[ChoiceDelta]:
        """WAITING_PROMPT_LOGPROBS: P's set (or sample 0's) completes it; everything else waits, in order."""
        if source == SHARED:
            return self._resume()
        if source != "prefill" or self.gather is None:
            self.held.append((source, item))
            return []
        if isinstance(item, EngineGone):  # its set will not come: prefill on the decode engine instead
            raise Retry(f"prefill engine {item.engine_id} left ({item.reason}) before the prompt logprobs came",
                        exclude=self.submission.route.prefill.control_address, force_local=True)
        if not isinstance(item, PromptLogprobsChunk):  # P's token or error came without its set
            raise self.gather.missing("decode")
        self.gather.add(source, item)
        return self._resume() if self.gather.complete else []

    def _resume(self) -> list[ChoiceDelta]:
        """The first token's prompt logprobs are in: what was held, in its order."""
        self.state = RelayState.WAITING_FIRST_TOKEN
        held, self.held = self.held, []
        return [delta for source, item in held for delta in self._receive(source, item)]

    def _from_decode(self, delta: TokenDelta) -> list[ChoiceDelta]:
        """WAITING_DECODE or STREAMING: D's stream; its first token, P's again, is dropped."""
        if self.state is RelayState.WAITING_DECODE and delta.token_ids:
            delta = without_first_token(delta, self.first_token)
            self.state = RelayState.STREAMING
        return self._relayed("decode", delta)

    def _relayed(self, source: str, delta: TokenDelta) -> list[ChoiceDelta]:
        if source == "decode":
            self.submission.finished = delta.finish_reason is not None
        choice_delta = self._consume(delta)
        if self.rows is not None:
            choice_delta.prompt_logprobs, self.rows = self.rows, None
        if choice_delta.finish_reason is not None:
            self.state = RelayState.FINISHED
            return [choice_delta]
        if choice_delta.token_ids:  # tokens flow: P's part is over for the router
            self.submission.release_prefill()
        return [choice_delta] if choice_delta.token_ids or choice_delta.text else []

    def _consume(self, delta: TokenDelta) -> ChoiceDelta:
        """The delta's tokens up to a stop string's match, as text. A delta that finished with "stop" ends
        with the engine's stop token (EOS or a stop_token_ids one): the detokenizer leaves its text out (unless
        include_stop_str_in_output), as vLLM does; unless the request's structured output was complete, whose
        last token is text like any other."""
        if self.spec.prompt_only:  # echo without generation: the token the engines had to make is not shown
            return ChoiceDelta(self.spec.index, "", [], [], "length", None, delta.num_cached_tokens)
        new_ids: list[int] = []
        last = len(delta.token_ids) - 1
        ends_with_stop_token = delta.ends_with_stop_token
        for position, token_id in enumerate(delta.token_ids):
            new_ids.append(token_id)
            self.detokenizer.add_tokens([token_id], ends_with_stop_token=position == last and ends_with_stop_token)
            if self.detokenizer.stopped_by is not None:
                break
        self.token_ids.extend(new_ids)
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        if self.detokenizer.stopped_by is not None:
            finish_reason, stop_reason = "stop", self.detokenizer.stopped_by
        text = self.detokenizer.take_new_text(finished=finish_reason is not None)
        return ChoiceDelta(self.spec.index, text, new_ids, list(delta.logprobs[:len(new_ids)]),
                           finish_reason, stop_reason, delta.num_cached_tokens)


def engine_failure(source: str, delta: TokenDelta) -> Exception:
    """What an engine's error or abort means: a retry, or the error the client sees."""
    message = delta.error or f"the {source} engine ended the request ({delta.finish_reason})"
    if delta.error_code == "engine_step_failed":  # final: another engine would fail the same way
        return EngineFailed(f"the {source} engine failed while running the request: {message}")
    if source == "prefill":
        return Retry(f"prefill failed: {message}", force_local=True)
    if delta.error_code == "invalid_request":  # the request's own fault, after tokens too (a constraint that
        return InvalidRequest(message)  # fails mid-way): a 400, or in a stream an error event after them
    return EngineFailed(f"the decode engine failed the request: {message}")


def without_first_token(delta: TokenDelta, first_token: int) -> TokenDelta:
    """D's first delta, less the first token P already streamed."""
    if delta.token_ids[0] != first_token:
        raise EngineFailed(f"the decode engine continued from token {delta.token_ids[0]}, not from the first token "
                           f"{first_token} the prefill engine sampled and the client already has; retry the request")
    return TokenDelta(**{**vars(delta), "token_ids": delta.token_ids[1:], "logprobs": delta.logprobs[1:]})


class PromptLogprobsGather:
    """One attempt's prompt logprobs, gathered per engine that may send them (P, or D when it prefills the
    prompt itself); the first whole set is the choice's."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.by_source = {source: PromptLogprobsAssembler(len(prompt_token_ids)) for source in ("prefill", "decode")}

    @property
    def complete(self) -> bool:
        return any(assembler.result is not None for assembler in self.by_source.values())

    def add(self, source: str, chunk: PromptLogprobsChunk) -> None:
        try:
            self.by_source[source].add(chunk.msg, chunk.rows)
        except ProtocolError as exc:
            raise EngineFailed(f"the {source} engine sent prompt logprobs that do not fit the prompt: {exc}",
                               code="internal_error") from exc

    def result(self, source: str) -> PromptRows:
        """The whole set, at the first token; its absence is the engine's fault, never silently skipped."""
        for assembler in self.by_source.values():
            if assembler.result is not None:
                return self._checked(source, assembler.result)
        raise self.missing(source)

    @staticmethod
    def missing(source: str) -> EngineFailed:
        return EngineFailed(f"the {source} engine sent the first token before the prompt logprobs the request "
                            "asked for: the engine is at fault; retry, or report it with the engine's logs",
                            code="internal_error")

    def _checked(self, source: str, rows: PromptRows) -> PromptRows:
        """Each position's first entry is the prompt token's (control/prompt_logprobs.py): the responses read it."""
        for position in range(1, len(rows)):
            sent, expected = next(iter(rows[position])), self.prompt_token_ids[position]
            if sent != expected:
                raise EngineFailed(f"the {source} engine sent prompt logprobs for token {sent} at prompt position "
                                   f"{position}, which holds {expected}: the engine is at fault; report it with the "
                                   "engine's logs", code="internal_error")
        return rows
