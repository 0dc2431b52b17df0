"""An engine whose queued prompts cannot get KV blocks (they are held for a peer, as a prefill engine holds
computed prompts for their decode engines) has no runnable work, so its loop waits for input instead of
stepping empty steps in a tight loop; the engine on the other core of a 2-core machine then ran 10x slower
(docs/results.md, "CPU threads and a full KV pool")."""

from __future__ import annotations

from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, PROMPT_LEN = 4, 8, 20  # one prompt takes 5 blocks (6 with its first token): two do not fit


class HoldsFinished(KVConnector):
    """Keeps a finished request's blocks until `release` (a prefill engine's delayed free)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.released: set[str] = set()

    def on_request_finished(self, request, block_ids) -> bool:
        self.held.add(request.request_id)
        return True

    def poll(self) -> ConnectorEvents:
        events = ConnectorEvents()
        events.sent, self.released = self.released, set()
        return events


def test_queued_prompts_that_cannot_get_blocks_are_not_runnable_work(model_factory):
    connector = HoldsFinished()
    engine = EngineCore(ModelConfig.from_hf(model_factory("llama"), dtype="float32"),
                        CacheConfig(BLOCK_SIZE, NUM_BLOCKS), SchedulerConfig(max_num_batched_tokens=64),
                        connector=connector)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for request_id, first in (("held", 3), ("queued", 40)):
        engine.add_request(engine.make_request(request_id, list(range(first, first + PROMPT_LEN)), params))
    assert engine.has_runnable_work()
    engine.step()  # computes "held" (whose blocks stay), "queued" does not fit beside it
    assert connector.held == {"held"} and engine.has_runnable_work(), "not known yet: the step ran"
    engine.step()
    assert engine.scheduler.waiting and not engine.has_runnable_work(), "an empty step: nothing can run"
    connector.released.add("held")
    engine.step()  # the blocks come back: "queued" runs
    assert not engine.scheduler.waiting and connector.held == {"held", "queued"}
