"""Structured output: a request's constraint (SamplingParams.structured_kind / structured_spec) as an
llguidance matcher, the mask it puts on each step's logits, and the tokens it consumes.

Every output token goes through the request's matcher, wherever it was sampled: here, or on the
prefill engine (the first token, which the decode engine appends as its own). So a disaggregated
request is constrained the same way as a colocated one. The request ends ("stop") once its constraint
is complete. Logprobs of a constrained request are those of the masked logits (as vLLM's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdserve.engine.grammar import check_isolated, checked_grammar
from pdserve.engine.request import InvalidRequestError, Request, SamplingParams

_BITS = torch.arange(32, dtype=torch.int32)  # one bit per token of a 32-token bitmask word


class GrammarState:
    """One request's matcher: what the next token may be, and the tokens it has taken."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.dead_end = False  # no token continues the output, and it does not fit the constraint yet

    def accept(self, token_id: int) -> bool:
        return not self.dead_end and self.matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The constraint is satisfied and admits no further token (the request stops)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        if self.dead_end:
            return ("no token can continue the output, and it does not fit the constraint yet: the constraint "
                    "cannot be satisfied (a rule that refers only to itself, or a pattern that matches nothing?)")
        return self.matcher.get_error()


# A constraint at least this long (a JSON schema of 16 KB and up) is compiled on a thread, so the engine loop
# steps on meanwhile: llguidance leaves the GIL while it compiles (the loop's longest pause measured 19 ms
# during three 0.28 s compiles).
BACKGROUND_COMPILE_CHARS = 1 << 14
# Compiled constraints an engine keeps, newest used last: a request whose constraint is among them gets a
# copy of its matcher (40 us) instead of a compile (0.28 s for a 184 KB JSON schema on this CPU).
MATCHER_CACHE_SIZE = 128


class StructuredOutputCompiler:
    """Per engine: the model's tokenizer as llguidance sees it (built on the first constrained request,
    ~0.4 s for a 49k vocabulary), and a fresh matcher per constrained request, copied from the last
    MATCHER_CACHE_SIZE constraints' compiled ones (an application sends the same schema again and again)."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, spec) -> unused matcher
        self.num_compiled = 0  # constraints compiled since start (a cache hit compiles none)

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                from pdserve.engine.tokenizer import load_tokenizer

                self._tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(self.model_dir), n_vocab=self.vocab_size)
            return self._tokenizer

    def grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """The request's matcher; None when it has no constraint. A constraint that does not compile is
        an InvalidRequestError naming the problem."""
        if params.structured_kind is None:
            return None
        key = (params.structured_kind, params.structured_spec)
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(*key)
            self._compiled[key] = template
            if len(self._compiled) > MATCHER_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarState(template.deep_copy())

    def compiles_at_once(self, params: SamplingParams) -> bool:
        """Whether the request's matcher is made in the engine loop: no constraint, a compiled one, or a
        small one (about 2 ms). A large new one is compiled on a thread (PendingConstraints)."""
        return (params.structured_kind is None or len(params.structured_spec) < BACKGROUND_COMPILE_CHARS
                or (params.structured_kind, params.structured_spec) in self._compiled)

    def _compile(self, kind: str, spec: str) -> Any:
        """The constraint's matcher, compiled here once a worker process has compiled it first (a crash of
        the compiler there fails this request, not the engine)."""
        from llguidance import LLMatcher

        check_isolated(kind, spec)
        tokenizer = self._ll_tokenizer()
        # log_level 0: a matcher's errors reach the client in the request's error, not the engine's stderr
        matcher = LLMatcher(tokenizer, checked_grammar(kind, spec, tokenizer), log_level=0)
        self.num_compiled += 1
        return matcher


class PendingConstraints:
    """Requests whose large constraint compiles on a thread; each joins the scheduler once its matcher is
    made (or fails as an invalid request). One thread: compiles queue, and take at most one core."""

    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.compiler = compiler
        self.requests: dict[str, tuple[Request, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def start(self, request: Request) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-grammar")
        future = self._pool.submit(self.compiler.grammar_state, request.sampling_params)
        self.requests[request.request_id] = (request, future)

    def get(self, request_id: str) -> Request | None:
        pending = self.requests.get(request_id)
        return pending[0] if pending is not None else None

    def abort(self, request_id: str) -> bool:
        """Forget a request still compiling (its compile finishes unused)."""
        return self.requests.pop(request_id, None) is not None

    def take_ready(self) -> list[tuple[Request, Exception | None]]:
        """(request, None) for each request whose matcher is made (request.grammar set), (request, error)
        for each whose constraint did not compile."""
        ready = []
        for request_id, (request, future) in list(self.requests.items()):
            if not future.done():
                continue
            del self.requests[request_id]
            error = future.exception()
            if error is None:
                request.grammar = future.result()
                error = _advance_or_error(request)
            ready.append((request, error))
        return ready


def advance_over_output(request: Request) -> None:
    """A resumed request's matcher taken over the output it already has (engine_core.resume_output), so that
    it constrains what comes next; a token it refuses is an InvalidRequestError."""
    if request.grammar is None:
        return
    for position, token_id in enumerate(request.output_token_ids):
        if not request.grammar.accept(token_id):
            raise InvalidRequestError(f"resume token {token_id} at output position {position} does not fit the "
                                      f"request's structured output: resume with the tokens that engine generated")


def _advance_or_error(request: Request) -> Exception | None:
    try:
        advance_over_output(request)
    except InvalidRequestError as exc:
        return exc
    return None


def mask_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Logits [R, V] with every token a constrained request's matcher forbids set to -inf (float32).
    A matcher in an error state leaves its row as it is: the token it gets then fails the request."""
    rows = [i for i, request in enumerate(requests) if request.grammar is not None and not request.grammar.error]
    if not rows:
        return logits
    vocab = logits.shape[1]
    # [r, ceil(V / 32)] int32: bit j of word w allows token 32 w + j. Filled through llguidance's pointer
    # API: its torch helpers module compiles a kernel with torch.compile at import (about 2 s here).
    bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for slot, row in enumerate(rows):
        words = bitmask[slot]
        requests[row].grammar.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
    allowed = unpack_bitmask(bitmask.to(logits.device), vocab)  # [r, V] bool
    for slot, row in enumerate(rows):  # a dead end: its request fails on the token it gets
        matcher = requests[row].grammar.matcher
        if matcher.is_stopped() and not matcher.is_accepting():  # llguidance then allows EOS alone
            requests[row].grammar.dead_end = True
    logits = logits.float()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[r, W] int32 words (bit j of word w allows token 32 w + j) -> [r, vocab] bool, in plain torch (the
    library's own apply is a torch.compile'd kernel whose first call took 2.6-19 s on this CPU)."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1  # [r, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
