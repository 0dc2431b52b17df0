"""A discrete-event simulator of a pdserve cluster: xPyD engines behind the router's policies, each a
continuous-batching scheduler with a token budget, chunked prefill and a KV pool that preempts.

What it models (docs/benchmarking/plan.md says why each choice):
- the router: prefill policy (round_robin; least_loaded and prefix_aware both as least queued prefill
  tokens, since no prefix cache is simulated), decode policy (round_robin, least_kv), and local prefill
  on the decode engine when there are no prefill engines or the prompt is <= local_prefill_threshold;
- one engine: each step runs every decoding request's next token, then prompt chunks up to the token
  budget (running chunks first, then waiting prompts in arrival order), admitting only what the KV pool
  holds; a decode that cannot grow preempts the newest request, which is recomputed later;
- step time from the profile's fits: prefill-only steps by the prefill fit, steps with decodes by the
  decode fit plus the prefill fit's per-token and attention terms for the chunks in them (its context term:
  what the attention backend reads); what a CPU host adds (co-run factors, the host's CPU, the attention's
  padding) comes from HostEffects (host_effects.py), nothing on a GPU profile;
- disaggregation: the decode engine allocates the prompt's blocks when it admits the request (KVWant);
  the transfer starts when both the prompt is computed and the want is there, lasts latency + bytes /
  bandwidth (streamed: only latency after the prefill), and takes the sending and receiving CPU time of
  the profile's link from the engines' own cores: the prefill engine's next step and the decode
  engine's next step are that much later. The prefill engine publishes the first token as soon as the
  step that completes the prompt samples it, before the KV moves (docs/design/wire-protocol.md); the decode
  engine's stream goes on from the second token once the KV has landed.

Events run on simpy's queue. Decode-only
stretches of an engine run as one event of k steps (until the next request finishes), cut at the next step
boundary when a new arrival or KV lands there; one engine per tier admits a remote arrival after the fact, where
that changes no time (the run goes on to its KV's landing), so that a request cuts its engine's run once, not twice.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass, field

try:
    import simpy
except ImportError as exc:  # a dependency of pdserve; missing only from an install that skipped it
    raise ImportError('pdserve plan needs simpy, a dependency of pdserve: pip install -e . (or pip install simpy)'
                      ) from exc

from pdserve.kernels.length_groups import group_padding
from pdserve.planner.model.adaptive import AdaptivePolicy, AdaptiveTargets, RecentWork
from pdserve.planner.model.host_effects import DECODING, IDLE, NO_HOST_EFFECTS, PREFILLING, HostEffects
from pdserve.planner.profile.corun_fit import NO_CORUN, CoRun
from pdserve.planner.profile.fit import EngineSettings, Profile

PREFILL_POLICIES = ("round_robin", "least_loaded", "prefix_aware")
DECODE_POLICIES = ("round_robin", "least_kv")


@dataclass(frozen=True)
class StepModel:
    """Seconds of one engine step and of one KV transfer, from a profile's fits: the physical terms (what a CPU host
    adds is HostEffects')."""
    prefill_intercept: float
    prefill_per_token: float
    prefill_per_attention: float
    decode_intercept: float
    decode_per_seq: float
    decode_per_context: float
    transfer_latency: float
    transfer_per_byte: float
    sender_cpu_per_byte: float = 0.0  # the sending engine's CPU per byte of KV, taken before its next step
    receiver_cpu_per_byte: float = 0.0  # ... the receiving engine's

    @classmethod
    def from_profile(cls, profile: Profile) -> StepModel:
        """The profile's fits."""
        p, d, t = (profile.prefill_fit.coefficients, profile.decode_fit.coefficients,
                   profile.transfer_fit.coefficients)
        return cls(p["intercept"], p["tokens"], p["attention"], d["intercept"], d["batch"], d["context"],
                   max(t["intercept"], 0.0), t["bytes"], profile.link_cpu_per_byte("sender"),
                   profile.link_cpu_per_byte("receiver"))

    def step_seconds(self, num_decodes: int, context: int, prefill_tokens: int, attention: float,
                     slowdown: CoRun = NO_CORUN) -> float:
        """slowdown: how many times as long the decode part's weights and KV reads take (other engines of the host
        at work beside it: SharedHost.slowdown); the prompt chunks' part does not change."""
        chunks = self.prefill_per_token * prefill_tokens + self.prefill_per_attention * attention
        if num_decodes:
            return self.decode_seconds(num_decodes, context, slowdown) + chunks
        return self.prefill_intercept + chunks

    def decode_seconds(self, batch, attended, slowdown: CoRun = NO_CORUN):
        """A decode-only step of `batch` requests whose attention reads `attended` tokens (floats, or numpy arrays
        of them: one step per element), its two parts slowed by `slowdown`."""
        weights = self.decode_intercept + self.decode_per_seq * batch
        return weights * slowdown.weights + self.decode_per_context * attended * slowdown.kv_reads


@dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int
    num_decode: int
    settings: EngineSettings = field(default_factory=EngineSettings)
    kv_bytes_per_token: int = 46080
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_kv"
    local_prefill_threshold: int = 0
    kv_streaming: bool = False
    adaptive: AdaptiveTargets | None = None  # None: fixed roles; else num_decode dual-role engines, this policy's SLOs

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError(f"{self.num_prefill}P{self.num_decode}D: a cluster needs at least one decode engine "
                             "(0P = colocated)")
        if self.prefill_policy not in PREFILL_POLICIES or self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"unknown policy {self.prefill_policy}/{self.decode_policy}: prefill one of "
                             f"{', '.join(PREFILL_POLICIES)}, decode one of {', '.join(DECODE_POLICIES)}")

    @property
    def name(self) -> str:
        return "adaptive" if self.adaptive else f"{self.num_prefill}P{self.num_decode}D"


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    num_computed: int = 0  # prompt tokens computed on the engine prefilling it
    num_generated: int = 0  # up to join_clock while decoding
    kv_tokens: int = 0  # KV slots allocated on admission (whole blocks)
    join_clock: int = 0  # the decode engine's clock when it began decoding
    finish_clock: int = 0  # ... and when it will have generated its last token
    remote: bool = False
    want_time: float | None = None  # the decode engine allocated its blocks
    prompt_done: float | None = None  # the prefill engine computed it
    first_token: float | None = None
    second_token: float | None = None  # the decode engine's first step with the request (remote: after its KV)
    finish: float | None = None
    num_preemptions: int = 0
    prefill_engine: SimEngine | None = field(default=None, repr=False)
    decode_engine: SimEngine | None = field(default=None, repr=False)

    @property
    def recompute_len(self) -> int:
        """Tokens to compute before the next token: the prompt, plus what it generated before a preemption."""
        return self.prompt_len + self.num_generated

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def first_itl(self) -> float | None:
        """The wait for the second token: a remote request's KV transfer and admission, then a decode step."""
        return None if self.second_token is None else self.second_token - self.first_token


DEADLINE_MARGIN = 1e-9  # relative and absolute slack on a deadline, so that float rounding never counts a miss early


class BudgetExceeded(Exception):
    """More requests missed an SLO than the attainment target allows: the run cannot meet it."""


@dataclass
class MissBudget:
    """Stops a run (a goodput probe) as soon as it is sure to miss the attainment target. A request is judged
    on TTFT when its first token is out, on TPOT and E2EL once the time they allow has passed unfinished, and
    on every SLO when it finishes; it counts once (weights: how many requests of the judged run one request
    stands for, simulate_tiers' prefill tier)."""
    slos_s: dict[str, float]  # SimRequest property -> its limit in seconds
    max_misses: int
    weights: dict[int, int] | None = None  # request index -> requests it stands for; None: 1 each
    num_missed: int = 0
    missed: set[int] = field(default_factory=set)  # indexes already counted
    deadlines: list[tuple[float, int, SimRequest]] = field(default_factory=list)  # heap: unfinished past it = miss

    def judge_first_token(self, request: SimRequest) -> None:
        limit = self.slos_s.get("ttft")
        if limit is not None and request.ttft > limit:
            self._miss(request)
            return
        deadline = math.inf
        if "tpot" in self.slos_s and request.output_len > 1:
            deadline = request.first_token + self.slos_s["tpot"] * (request.output_len - 1)
        if "e2el" in self.slos_s:
            deadline = min(deadline, request.arrival + self.slos_s["e2el"])
        if deadline < math.inf:
            heapq.heappush(self.deadlines, (deadline * (1 + DEADLINE_MARGIN) + DEADLINE_MARGIN, request.index, request))

    def judge_unfinished(self, now: float) -> None:
        """Requests still unfinished past their deadline: their TPOT or E2EL will exceed the limit."""
        deadlines = self.deadlines
        while deadlines and deadlines[0][0] < now:
            _, _, request = heapq.heappop(deadlines)
            if request.finish is None:
                self._miss(request)

    def judge(self, request: SimRequest) -> None:
        if any(getattr(request, name) > limit for name, limit in self.slos_s.items()):
            self._miss(request)

    def _miss(self, request: SimRequest) -> None:
        if request.index in self.missed:
            return
        self.missed.add(request.index)
        self.num_missed += 1 if self.weights is None else self.weights.get(request.index, 0)
        if self.num_missed > self.max_misses:
            raise BudgetExceeded


class Simulation:
    """The clock and the event queue (simpy's): engines schedule callbacks at absolute times."""

    def __init__(self) -> None:
        self.env = simpy.Environment()

    @property
    def now(self) -> float:
        return self.env.now

    def at(self, time: float, callback, *args) -> simpy.Timeout:
        """callback(*args) at `time`; the event, whose callbacks a caller may clear to cancel it."""
        event = self.env.timeout(max(0.0, time - self.env.now))
        event.callbacks.append(lambda _: callback(*args))
        return event

    def run(self) -> None:
        self.env.run()


class SimEngine:
    """One engine's scheduler, in tokens. Decoding requests advance together, so they are counted by a
    clock (decode tokens every decoding request has had since the engine started): a request's tokens
    are its tokens when it joined plus the clock's advance since, and none is touched per step."""

    def __init__(self, sim: Simulation, cluster: SimCluster, index: int, role: str) -> None:
        self.sim, self.cluster, self.index, self.role = sim, cluster, index, role
        self.env = sim.env  # its clock read directly: the loop reads it on every event
        settings = cluster.spec.settings
        self.block_size = settings.block_size
        self.budget = settings.max_num_batched_tokens
        self.max_num_seqs = settings.max_num_seqs
        self.capacity = settings.num_kv_blocks * settings.block_size  # KV pool, tokens
        self.model, self.effects = cluster.model, cluster.effects
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # admitted, prompt (or recompute) not done
        self.decoding: dict[int, SimRequest] = {}  # by index, in the order they joined
        self._finishes: list[tuple[int, int, SimRequest]] = []  # (finish clock, index, request)
        self.clock = 0
        self._context_base = 0  # sum over decoding of (tokens at join - clock at join)
        self._finish_clock_sum = 0  # sum over decoding of the clock at which each finishes
        self._longest: list[tuple[int, int]] = []  # max-heap of (-(tokens at join - clock at join), index), lazy
        self._group_padding: int | None = None  # a grouping backend's padding, from when the batch last changed
        self.fixed_tokens = 0  # KV of prefilling requests, requests waiting for KV, prompts held for a transfer
        self.waiting_tokens = 0  # prompt tokens not yet admitted (the router counts them: queued or pending)
        self.queued_tokens = 0  # tokens of the prompts not yet computed in full (waiting and prefilling)
        self.num_waiting_for_kv = 0
        self.landed: list[SimRequest] = []  # KV arrived, not yet taken in by the loop
        self._announce: list[SimRequest] = []  # KV taken in: first token published after the next step
        self._second_pending: list[SimRequest] = []  # joined decoding with one token: the next step makes the second
        self.cpu_debt = 0.0  # transfer CPU taken from this engine's core, paid before its next step
        self.busy = False
        self.activity = IDLE  # of its step under way: PREFILLING (it has prompt tokens), DECODING or IDLE
        self._run: tuple | None = None  # a decode run: (start, num_steps, first step s, growth s/step)
        self._run_event: simpy.Timeout | None = None  # its end; a cut run's is cancelled
        self.expected: deque[SimRequest] = deque()  # arrivals known ahead (expect), in arrival order
        self.knows_ahead = False  # fed by expect(): its transfers' ends are inputs known ahead too
        self._transfers: list[tuple[float, int, SimRequest, int]] = []  # heap: (end, number, request, bytes)
        self._num_transfers = 0
        self._due_at: float | None = None  # when the next expected arrival wakes this engine from idle
        self._admitted_at: dict[int, float] = {}  # remote arrivals a run went past: index -> when admission was due
        self.num_preemptions = 0
        self.prompt_work = None if role != "dual" else RecentWork(cluster.spec.adaptive.recent_s)

    # ---- load figures the router reads ----

    def kv_usage(self) -> float:
        """The fraction of the pool in use now, as the router reads it: with the KV written by the steps of a decode
        run under way (the engine reports its blocks every heartbeat, not only where the simulator cuts a run)."""
        live = self.used_tokens() + len(self.decoding) * self.steps_into_run()
        return (live + self.waiting_tokens) / self.capacity

    def steps_into_run(self) -> int:
        """Steps of the decode run under way completed by now (0 outside a run)."""
        if self._run is None:
            return 0
        start, num_steps, first, growth = self._run
        return min(_steps_done_by(self.env.now - start, first, growth), num_steps)

    def decodes_remote(self, request: SimRequest) -> bool:
        """Whether this engine decodes the request from KV another engine computes (a prefill engine, or a dual-role
        engine prefilling it for this one)."""
        return request.remote and request.prefill_engine is not self

    def remaining_tokens(self) -> int:
        """Tokens the decoding requests have still to generate, all together, as of now."""
        started = self._run is not None and self._run[0] < self.env.now  # (a run starts after its transfer CPU)
        return self._finish_clock_sum - len(self.decoding) * (self.clock + (self.steps_into_run() if started else 0))

    def num_inflight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding) + self.num_waiting_for_kv

    def context_tokens(self) -> int:
        return self._context_base + len(self.decoding) * self.clock

    def attended_tokens(self) -> int:
        """The context the next decode step's attention reads: the sum of the contexts, or batch x the longest
        where the backend pads (HostEffects.decode_pads_to_longest), or the sum plus each length group's padding
        where it groups (decode_groups_by_length). All grow by the batch size per step: a group's padding is set by
        the differences between its contexts, which stay as they are while every context grows by one (the groups
        are taken when a request joins or leaves; the backend's 10% bound, which grows with the contexts, may merge
        two of them sooner)."""
        if self.effects.decode_groups_by_length and self.decoding:
            if self._group_padding is None:  # the groups as of now; kept until a request joins or leaves
                self._group_padding = group_padding([_join_key(r) + self.clock for r in self.decoding.values()])
            return self.context_tokens() + self._group_padding
        if not self.effects.decode_pads_to_longest or not self.decoding:
            return self.context_tokens()
        longest = self._longest
        while self.decoding.get(longest[0][1]) is None or _join_key(self.decoding[longest[0][1]]) != -longest[0][0]:
            heapq.heappop(longest)  # left decoding (or rejoined under another key) since it was pushed
        return len(self.decoding) * (self.clock - longest[0][0])

    def used_tokens(self) -> int:
        return self.fixed_tokens + self.context_tokens()

    # ---- input ----

    def add(self, request: SimRequest) -> None:
        self._enqueue(request)
        self.wake()

    def _enqueue(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.waiting_tokens += request.prompt_len
        if not self.decodes_remote(request):
            self.queued_tokens += request.prompt_len

    def expect(self, requests: list[SimRequest]) -> None:
        """Arrivals known ahead (one engine fed without a router, simulate_tiers), and then the ends of its
        transfers too (expect_transfer). The loop takes them in when it reaches their time, and a decode run
        ends at the step boundary after the next one, as their wake would cut it: no event per input while
        the engine is busy, the same times as add(), kv_landed() and transfer_sent()."""
        self.knows_ahead = True
        self.expected = deque(sorted(requests, key=lambda r: r.arrival))
        self._sleep_until_expected()

    def expect_transfer(self, end: float, request: SimRequest, num_bytes: int) -> None:
        self._num_transfers += 1  # ties end in the order they were started, as events would fire
        heapq.heappush(self._transfers, (end, self._num_transfers, request, num_bytes))

    def _next_input(self) -> float:
        arrival = self.expected[0].arrival if self.expected else math.inf
        return min(arrival, self._transfers[0][0]) if self._transfers else arrival

    def _sleep_until_expected(self) -> None:
        due = self._next_input()
        if due < math.inf and self._due_at != due:
            self._due_at = due
            self.sim.at(due, self._expected_due)

    def _expected_due(self) -> None:
        self._due_at = None
        if not self.busy:
            self.busy = True
            self.iterate()

    def _take_expected(self) -> None:
        expected, transfers, now = self.expected, self._transfers, self.env.now
        while expected and expected[0].arrival <= now:
            request = expected.popleft()
            want_time = self._admitted_at.pop(request.index, None)
            if want_time is None:
                self._enqueue(request)
            else:
                self._admit_after_the_fact(request, want_time)
        while transfers and transfers[0][0] <= now:
            _, _, request, num_bytes = heapq.heappop(transfers)
            if self.role == "decode":
                self._land(request)
            else:
                self._sent(request, num_bytes)

    def kv_landed(self, request: SimRequest) -> None:
        self._land(request)
        self.wake()

    def _land(self, request: SimRequest) -> None:
        self.landed.append(request)
        self.cpu_debt += request.prompt_len * self.cluster.spec.kv_bytes_per_token * self.model.receiver_cpu_per_byte

    def wake(self) -> None:
        """New input: start a loop iteration now if idle, or end a decode run at its next step boundary."""
        if not self.busy:
            self.busy = True
            self.sim.at(self.env.now, self.iterate)
        elif self._run is not None:
            self._cut_run()

    # ---- the loop ----

    def iterate(self) -> None:
        if self.knows_ahead:
            self._take_expected()
        now = self.env.now + self.cpu_debt
        self.cpu_debt = 0.0
        if self.cluster.budget is not None:
            self.cluster.budget.judge_unfinished(self.env.now)
        for request in self.landed:  # the first token is out already (from the prefill engine)
            self.num_waiting_for_kv -= 1
            self.fixed_tokens -= request.kv_tokens
            if request.first_token is None:  # not yet published: it goes out with the next step's tokens
                self._announce.append(request)
            self._join_decoding(request, 1, now)
        self.landed.clear()
        self._preempt_to_fit()
        chunks = self._admit()
        num_decodes = len(self.decoding)
        if self.cluster.host.tracks_activity:
            self.cluster.host.set_activity(self, PREFILLING if chunks else DECODING if num_decodes else IDLE)
        if not num_decodes and not chunks:
            self._announce_first_tokens(now)
            self.busy = False
            self._sleep_until_expected()
            return
        if not chunks:
            self._start_decode_run(now)
            return
        tokens = sum(n for _, n in chunks)
        attention = sum(n * (n + 2 * r.num_computed) for r, n in chunks)
        step = self.model.step_seconds(num_decodes, self.attended_tokens(), tokens, attention,
                                       self.cluster.host.slowdown(self))
        seconds = self.cluster.host.charge(step, num_decodes, chunks)
        if self.prompt_work is not None:  # what the prompts add to the step, as they would to a decode step
            self.prompt_work.add(now, self.model.step_seconds(1, 0, tokens, attention) - self.model.decode_seconds(1, 0))
        if self._second_pending:
            self._second_token_at(now + seconds)
        self.sim.at(now + seconds, self._step_done, chunks)

    def _admit(self) -> list[tuple[SimRequest, int]]:
        """Prompt chunks of this step: running prompts first, then waiting ones while the pool holds them."""
        budget = self.budget - len(self.decoding)
        chunks = []
        for request in self.prefilling:
            if budget <= 0:
                break
            num = min(request.recompute_len - request.num_computed, budget)
            chunks.append((request, num))
            budget -= num
        while self.waiting and budget > 0 and self.num_inflight() - len(self.waiting) < self.max_num_seqs:
            request = self.waiting[0]
            kv_tokens = -(-request.recompute_len // self.block_size) * self.block_size
            if self.used_tokens() + kv_tokens > self.capacity:
                break
            self.waiting.popleft()
            self.waiting_tokens -= request.prompt_len
            self.fixed_tokens += kv_tokens
            request.kv_tokens = kv_tokens
            if self.decodes_remote(request):
                self._want(request)
                continue
            request.num_computed = 0
            self.prefilling.append(request)
            num = min(request.recompute_len, budget)
            chunks.append((request, num))
            budget -= num
        return chunks

    def _want(self, request: SimRequest) -> None:
        self.num_waiting_for_kv += 1
        request.want_time = self.env.now
        if request.prompt_done is not None:
            self.cluster.start_transfer(request)

    def _second_token_at(self, at: float) -> None:
        """The step starting now ends at `at` with the second token of each request that joined with one (one
        preempted before it gets the step after its recompute)."""
        for request in self._second_pending:
            if request.index in self.decoding:
                request.second_token = at
        self._second_pending.clear()

    def _announce_first_tokens(self, at: float) -> None:
        for request in self._announce:
            request.first_token = at
            self.cluster.first_token_out(request)
            if request.finish is not None:
                request.finish = max(request.finish, at)
                self.cluster.finished(request)
        self._announce.clear()

    def _step_done(self, chunks: list[tuple[SimRequest, int]]) -> None:
        now = self.env.now
        self._announce_first_tokens(now)
        if self.decoding:
            self.clock += 1
            self._finish_due(now)
        for request, num in chunks:
            request.num_computed += num
            if request.num_computed >= request.recompute_len:
                self.queued_tokens -= request.recompute_len  # a whole prompt until its first token, as the router counts
                self._prompt_computed(request, now)
        self.iterate()

    def _prompt_computed(self, request: SimRequest, now: float) -> None:
        self.prefilling.remove(request)
        self.fixed_tokens -= request.kv_tokens
        if request.remote and request.prefill_engine is self:
            self.fixed_tokens += request.kv_tokens  # held until the transfer ends
            request.prompt_done = now
            request.first_token = now  # published at once, before the KV moves
            self.cluster.first_token_out(request)
            if request.want_time is not None:
                self.cluster.start_transfer(request)
            return
        if request.first_token is None:
            request.first_token = now
            self.cluster.first_token_out(request)
        self._join_decoding(request, request.num_generated + 1, now)  # the step that completes a prompt samples

    def _join_decoding(self, request: SimRequest, num_generated: int, now: float) -> None:
        request.num_generated = num_generated
        if num_generated >= request.output_len:
            request.finish = now
            if request.first_token is not None:  # else when its first token goes out
                self.cluster.finished(request)
            return
        request.join_clock = self.clock
        self.decoding[request.index] = request
        if request.second_token is None:
            self._second_pending.append(request)
        self._context_base += request.prompt_len + num_generated - self.clock
        self._group_padding = None
        if self.effects.decode_pads_to_longest:
            heapq.heappush(self._longest, (-_join_key(request), request.index))
        request.finish_clock = self.clock + request.output_len - num_generated
        self._finish_clock_sum += request.finish_clock
        heapq.heappush(self._finishes, (request.finish_clock, request.index, request))

    def _leave_decoding(self, request: SimRequest) -> None:
        del self.decoding[request.index]
        self._finish_clock_sum -= request.finish_clock
        self._group_padding = None
        request.num_generated += self.clock - request.join_clock
        self._context_base -= request.prompt_len + request.num_generated - self.clock

    def _finish_due(self, now: float) -> None:
        finishes = self._finishes
        while finishes and finishes[0][0] <= self.clock:
            _, index, request = heapq.heappop(finishes)
            if self.decoding.get(index) is request:
                self._leave_decoding(request)
                request.finish = now
                self.cluster.finished(request)

    def transfer_sent(self, request: SimRequest, num_bytes: int) -> None:
        """The prefill side of a finished transfer: blocks freed; its CPU taken from this engine's core."""
        self._sent(request, num_bytes)
        self.wake()

    def _sent(self, request: SimRequest, num_bytes: int) -> None:
        self.fixed_tokens -= request.kv_tokens
        self.cpu_debt += num_bytes * self.model.sender_cpu_per_byte

    # ---- KV pool ----

    def _preempt_to_fit(self) -> None:
        """Every decoding request needs one more token's slot; preempt the newest while the pool is short."""
        while self.decoding and self.used_tokens() + len(self.decoding) > self.capacity:
            victim = self.decoding[next(reversed(self.decoding))]
            self._leave_decoding(victim)
            victim.num_preemptions += 1
            self.num_preemptions += 1
            victim.remote = False  # recomputed here: prompt + generated tokens
            victim.num_computed = 0
            self.waiting.appendleft(victim)
            self.waiting_tokens += victim.prompt_len
            self.queued_tokens += victim.recompute_len

    # ---- decode runs: k decode-only steps as one event ----

    def _start_decode_run(self, now: float) -> None:
        batch = len(self.decoding)
        room = (self.capacity - self.used_tokens()) // batch
        num_steps = max(1, min(self._finishes[0][0] - self.clock, room))
        slowdown = self.cluster.host.slowdown(self)  # a change cuts the run (SharedHost.set_activity), as for charge
        first = self.cluster.host.charge(self.model.step_seconds(batch, self.attended_tokens(), 0, 0.0, slowdown),
                                         batch)
        growth = self.cluster.host.charge(self.model.decode_per_context * batch * slowdown.kv_reads, 0)  # a token each
        if self.knows_ahead:
            num_steps = self._steps_before_input(now, num_steps, first, growth)
        if self._second_pending:
            self._second_token_at(now + first)
        self._run = (now, num_steps, first, growth)
        self._run_event = self.sim.at(now + _run_seconds(num_steps, first, growth), self._run_done)

    def _steps_before_input(self, now: float, num_steps: int, first: float, growth: float) -> int:
        """How far a run of an engine fed ahead goes before the loop must take an input: to the step boundary after
        the next transfer's end or arrival, as their wake would cut it. A remote arrival whose admission at the next
        boundary would come before its prompt is computed (its transfer then starts when the prompt is done) is
        admitted after the fact instead, and the run goes on to the boundary after its KV lands: one cut, not two,
        while nothing waits and the pool and max_num_seqs hold it from that boundary on."""
        if self._transfers and self._transfers[0][0] < now + _run_seconds(num_steps, first, growth):
            num_steps = min(num_steps, _steps_done_by(self._transfers[0][0] - now, first, growth) + 1)
        free, seats, batch = self.capacity - self.used_tokens(), self.max_num_seqs - self.num_inflight(), len(self.decoding)
        in_order = not self.waiting  # admitted after the fact only behind requests admitted after the fact
        for request in self.expected:  # in arrival order; none before now
            if request.arrival >= now + _run_seconds(num_steps, first, growth):
                break
            steps = _steps_done_by(request.arrival - now, first, growth) + 1
            admitted = now + _run_seconds(steps, first, growth)
            free -= -(-request.recompute_len // self.block_size) * self.block_size
            seats -= 1
            if in_order and request.remote and request.prompt_done is not None and admitted <= request.prompt_done:
                landed = request.prompt_done + self.cluster.wire_seconds(request, admitted)
                landed_steps = _steps_done_by(landed - now, first, growth) + 1
                in_order = seats >= 0 and 0 <= landed_steps < free // batch  # the pool holds it and one more step
            else:
                in_order = False
            if in_order:
                self._admitted_at[request.index] = admitted
                steps = landed_steps
            num_steps = min(num_steps, steps)
        return num_steps

    def speed_changed(self) -> None:
        """Another engine started or ended prompt (or decode) steps: a decode run ends at its next step boundary."""
        if self._run is not None:
            self._cut_run()

    def _admit_after_the_fact(self, request: SimRequest, want_time: float) -> None:
        """A remote request a run went past (_steps_before_input): admitted as at want_time, its transfer started."""
        request.kv_tokens = -(-request.recompute_len // self.block_size) * self.block_size
        self.fixed_tokens += request.kv_tokens
        self.num_waiting_for_kv += 1
        request.want_time = want_time
        self.cluster.start_transfer(request)

    def _cut_run(self) -> None:
        start, num_steps, first, growth = self._run
        done = _steps_done_by(self.env.now - start, first, growth)
        if done + 1 >= num_steps:
            return
        self._run_event.callbacks.clear()  # cancelled: it fires with nothing to call
        self._run = (start, done + 1, first, growth)
        self._run_event = self.sim.at(start + _run_seconds(done + 1, first, growth), self._run_done)

    def _run_done(self) -> None:
        start, num_steps, first, _ = self._run
        self._announce_first_tokens(start + first)
        self._run = self._run_event = None
        self.clock += num_steps
        self._finish_due(self.env.now)
        self.iterate()


def _join_key(request: SimRequest) -> int:
    """A decoding request's context minus its engine's clock: constant while it decodes."""
    return request.prompt_len + request.num_generated - request.join_clock


def _run_seconds(num_steps: int, first: float, growth: float) -> float:
    return num_steps * first + growth * num_steps * (num_steps - 1) / 2


def _steps_done_by(elapsed: float, first: float, growth: float) -> int:
    """The most steps m with _run_seconds(m) <= elapsed."""
    if growth <= 0:
        return int(elapsed // first)
    a, b = growth / 2, first - growth / 2
    if b * b + 4 * a * elapsed < 0:  # long before the run starts (it waits for its engine's transfer CPU)
        return 0
    m = int((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
    while m > 0 and _run_seconds(m, first, growth) > elapsed:
        m -= 1
    return m


class SimCluster:
    """The engines of one host behind the router, and what the host adds to their steps (HostEffects: nothing on a
    GPU profile)."""

    def __init__(self, spec: ClusterSpec, model: StepModel, budget: MissBudget | None = None,
                 effects: HostEffects = NO_HOST_EFFECTS) -> None:
        self.spec, self.model, self.budget, self.effects = spec, model, budget, effects
        self.sim = Simulation()
        self.policy = None if spec.adaptive is None else AdaptivePolicy(
            model, spec.adaptive, spec.settings.max_num_batched_tokens, spec.kv_bytes_per_token, spec.kv_streaming)
        self.prefills = [SimEngine(self.sim, self, i, "prefill") for i in range(spec.num_prefill)]
        self.decodes = [SimEngine(self.sim, self, i, "decode" if self.policy is None else "dual")
                        for i in range(spec.num_decode)]
        self._next = {"prefill": 0, "decode": 0}
        self.host = effects.host_of([*self.prefills, *self.decodes])

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for request in requests:
            self.sim.at(request.arrival, self.route, request)
        self.sim.run()
        return requests

    def first_token_out(self, request: SimRequest) -> None:
        if self.budget is not None:
            self.budget.judge_first_token(request)

    def finished(self, request: SimRequest) -> None:
        if self.budget is not None:
            self.budget.judge(request)

    def route(self, request: SimRequest) -> None:
        if self.policy is not None:
            self._route_adaptive(request)
            return
        decode = self._pick(self.decodes, "decode", self.spec.decode_policy == "round_robin",
                            lambda e: (e.kv_usage(), e.num_inflight(), e.index))
        request.decode_engine = decode
        if self.prefills and request.prompt_len > self.spec.local_prefill_threshold:
            prefill = self._pick(self.prefills, "prefill", self.spec.prefill_policy == "round_robin",
                                 lambda e: (e.queued_tokens, e.num_inflight(), e.index))
            request.prefill_engine, request.remote = prefill, True
            prefill.add(request)
        decode.add(request)

    def _route_adaptive(self, request: SimRequest) -> None:
        """Dual-role engines: the policy's pair; a prefill engine of None colocates on the decode engine."""
        prefill, decode = self.policy.choose(request, self.decodes)
        request.decode_engine = decode
        if prefill is not None:
            request.prefill_engine, request.remote = prefill, True
            prefill.add(request)
        decode.add(request)

    def _pick(self, engines: list[SimEngine], side: str, round_robin: bool, load) -> SimEngine:
        if round_robin or len(engines) == 1:
            engine = engines[self._next[side] % len(engines)]
            self._next[side] += 1
            return engine
        return min(engines, key=load)

    def start_transfer(self, request: SimRequest) -> None:
        num_bytes = request.prompt_len * self.spec.kv_bytes_per_token
        start = max(request.prompt_done, request.want_time)
        wire = self.wire_seconds(request, request.want_time)
        alone = request.decode_engine if request.prefill_engine is None else request.prefill_engine
        if (request.prefill_engine is None or request.decode_engine is None) and alone.knows_ahead:
            now = self.sim.now  # the time an event at start + wire would fire (simpy adds a delay to now)
            alone.expect_transfer(now + max(0.0, start + wire - now), request, num_bytes)
            return
        self.sim.at(start + wire, self._transfer_done, request, num_bytes)

    def wire_seconds(self, request: SimRequest, want_time: float) -> float:
        """A transfer's time on the link once both its prompt and its want are there (streamed: the latency)."""
        wire = self.model.transfer_latency
        if not (self.spec.kv_streaming and want_time <= request.prompt_done):
            wire += request.prompt_len * self.spec.kv_bytes_per_token * self.model.transfer_per_byte
        return wire

    def _transfer_done(self, request: SimRequest, num_bytes: int) -> None:
        if request.prefill_engine is not None:  # None: a decode tier simulated alone (simulate_tiers)
            request.prefill_engine.transfer_sent(request, num_bytes)
        if request.decode_engine is not None:  # None: a prefill tier simulated alone
            request.decode_engine.kv_landed(request)

    def run_tier(self, engine: SimEngine, requests: list[SimRequest]) -> list[SimRequest]:
        engine.expect(requests)
        self.sim.run()
        return requests


def check_requests(spec: ClusterSpec, prompt_lens: list[int], output_lens: list[int]) -> None:
    for name, values in (("prompt", prompt_lens), ("output", output_lens)):
        if values and min(values) < 1:
            raise ValueError(f"every {name} length must be at least 1 token")
    capacity = spec.settings.num_kv_blocks * spec.settings.block_size
    longest = max(map(operator.add, prompt_lens, output_lens), default=0)
    if longest > capacity:
        raise ValueError(f"a request of {longest} tokens does not fit the KV pool of {capacity} tokens: "
                         "give the engines more KV blocks or shorten the dataset")


def miss_budget(slos_ms: dict[str, float] | None, target: float, num_requests: int) -> MissBudget | None:
    """The misses a run of num_requests may have and still reach the attainment target."""
    if not slos_ms:
        return None
    allowed = num_requests - math.ceil(target * num_requests - 1e-9)
    return MissBudget({name: limit / 1000.0 for name, limit in slos_ms.items()}, allowed)


def simulate(spec: ClusterSpec, model: StepModel, arrivals: list[float], prompt_lens: list[int],
             output_lens: list[int], stop_below: tuple[dict[str, float], float] | None = None,
             effects: HostEffects = NO_HOST_EFFECTS) -> list[SimRequest]:
    """Every request's predicted times through the whole cluster and the router's policies, on one host with these
    effects. stop_below (SLOs in ms, attainment target): raise BudgetExceeded as soon as the run cannot reach the
    target."""
    check_requests(spec, prompt_lens, output_lens)
    requests = [SimRequest(i, float(a), int(p), int(o))
                for i, (a, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens))]
    budget = miss_budget(*stop_below, len(requests)) if stop_below else None
    return SimCluster(spec, model, budget, effects).run(requests)


def simulate_tiers(spec: ClusterSpec, model: StepModel, arrivals: list[float], prompt_lens: list[int],
                   output_lens: list[int], stop_below: tuple[dict[str, float], float] | None = None,
                   effects: HostEffects = NO_HOST_EFFECTS) -> list[SimRequest]:
    """A large cluster by one engine of each tier: the prefill engine takes every x-th request and the
    decode engine every y-th (round robin), the decode side's prompts done after the prefill delay the
    prefill engine gave the request at the same position of its own stream. Work ~ requests / x +
    requests / y instead of all requests through all engines. Exact for one engine per tier while the decode
    engine wants each prompt before it is computed; the prefill tier alone does not see late wants (a full decode
    pool) holding its blocks."""
    check_requests(spec, prompt_lens, output_lens)
    effects = effects.unshared()  # which engines of a large cluster share a host is not known
    x, y = spec.num_prefill, spec.num_decode
    threshold = spec.local_prefill_threshold
    decode_stream = [SimRequest(i, float(arrivals[i]), int(prompt_lens[i]), int(output_lens[i]))
                     for i in range(0, len(arrivals), y)]
    budget = miss_budget(*stop_below, len(decode_stream)) if stop_below else None
    if x:
        prefill_stream = [SimRequest(i, float(arrivals[i]), int(prompt_lens[i]), int(output_lens[i]), remote=True)
                          for i in range(0, len(arrivals), x) if prompt_lens[i] > threshold]
        delays = _prefill_tier_delays(spec, model, prefill_stream, decode_stream, budget, effects)
        for request in decode_stream:
            if request.prompt_len > threshold and delays:
                request.remote = True
                request.prompt_done = request.arrival + delays[_prefill_position(request, x, len(delays))]
                request.first_token = request.prompt_done  # the prefill engine publishes it
                if budget is not None:
                    budget.judge_first_token(request)
    cluster = SimCluster(ClusterSpec(0, 1, spec.settings, spec.kv_bytes_per_token, kv_streaming=spec.kv_streaming),
                         model, budget, effects)
    for request in decode_stream:
        request.decode_engine = cluster.decodes[0]
    return cluster.run_tier(cluster.decodes[0], decode_stream)


def _prefill_position(request: SimRequest, num_prefill: int, num_delays: int) -> int:
    """The position in the prefill engine's stream whose delay a decode-stream request takes."""
    return min(request.index // num_prefill, num_delays - 1)


def _prefill_tier_delays(spec: ClusterSpec, model: StepModel, prefill_stream: list[SimRequest],
                         decode_stream: list[SimRequest], budget: MissBudget | None, effects: HostEffects
                         ) -> list[float]:
    """The prefill engine's delay (prompt computed - arrival) per position of its stream. With a budget the
    tier stops once the decode-stream requests whose first token it makes late are more than allowed: a
    prefill request's delay is the TTFT of each decode-stream request mapped to its position."""
    tier_budget = None
    if budget is not None and "ttft" in budget.slos_s and prefill_stream:
        uses: dict[int, int] = {}
        for request in decode_stream:
            if request.prompt_len > spec.local_prefill_threshold:
                index = prefill_stream[_prefill_position(request, spec.num_prefill, len(prefill_stream))].index
                uses[index] = uses.get(index, 0) + 1
        tier_budget = MissBudget({"ttft": budget.slos_s["ttft"]}, budget.max_misses, uses)
    cluster = SimCluster(ClusterSpec(1, 1, spec.settings, spec.kv_bytes_per_token, kv_streaming=spec.kv_streaming,
                                     local_prefill_threshold=spec.local_prefill_threshold), model, tier_budget,
                         effects)
    for request in prefill_stream:
        request.want_time = request.arrival
        request.prefill_engine = cluster.prefills[0]
    cluster.run_tier(cluster.prefills[0], prefill_stream)
    return [r.prompt_done - r.arrival for r in prefill_stream]
