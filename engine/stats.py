"""An engine's typed figures: the snapshot EngineCore.stats() returns and the prefix-cache counters it
reads; their field names are EngineStats' (control.messages), so the engine loop sends them as they are."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.control.messages import StepTimes


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of admitted requests since start, in tokens (a preempted request looks up
    again when it is readmitted)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens whose KV was reused instead of computed


@dataclass(frozen=True)
class SchedulerStats:
    """One engine's queues, KV pool and prefix cache at one moment."""

    num_waiting: int
    num_running: int
    num_waiting_for_remote_kv: int
    kv_blocks_used: int
    kv_blocks_total: int
    queued_prefill_tokens: int  # prompt tokens of waiting requests not computed yet
    num_preemptions: int  # since start
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_times: StepTimes = StepTimes()  # recent steps' measured times (engine/step_times.py)
