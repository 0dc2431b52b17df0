"""A decode engine's check that a request fits its KV cache counts what a request whose prompt KV arrives whole
holds: a sliding layer group keeps only the blocks its window reaches (as allocate_slots gives them), not a
window and a prefill chunk. Near capacity, a Gemma 3 request that fits is accepted and decodes; one block more
is refused with the sentence that names the fix; a failed transfer recomputes the prompt here in chunks small
enough for the cache; no block is left behind."""

from __future__ import annotations

import pytest

from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from pdserve.engine.request import InvalidRequestError, RequestStatus, SamplingParams
from tests.engine.test_kv_cache_manager import make_request
from tests.engine.test_scheduler import FakeConnector
from tests.engine.test_transformers_backend import make_hf_model_dir

BLOCK, WINDOW, MAX_TOKENS = 4, 8, 4
PROMPT_LEN = 40  # 40 + 4 tokens: 11 blocks in the full group
# Gemma 3's 5 sliding layers and 1 full layer make 6 groups of one layer. Received, a sliding group holds at most
# ceil((8 + 4 - 1) / 4) = 3 blocks: 11 + 5 x 3 blocks, the whole pool. Computed here in chunks of the step's
# budget it would hold up to 11 blocks in every group (66).
NUM_BLOCKS = 11 + 5 * 3
ADDRESS = "tcp://127.0.0.1:5"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_dir(model_factory, tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("hf-gemma3"), "Gemma3TextConfig", "Gemma3ForCausalLM",
                             model_factory("llama"), head_dim=16, num_key_value_heads=2, sliding_window=WINDOW,
                             num_hidden_layers=6, query_pre_attn_scalar=24)


def _decode_engine(model_dir: str, connector: FakeConnector) -> EngineCore:
    return EngineCore(ModelConfig.from_hf(model_dir, dtype="float32"), CacheConfig(BLOCK, NUM_BLOCKS),
                      SchedulerConfig(max_num_batched_tokens=64), connector=connector)


def _run_to_end(engine: EngineCore, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not drain: a request hangs")


def _assert_no_blocks_held(engine: EngineCore) -> None:
    manager = engine.kv_cache_manager
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == NUM_BLOCKS
    manager.check_invariants()


@pytest.mark.parametrize("window", [4, 6, 8, 9])
def test_the_count_of_a_received_prompt_is_what_allocate_slots_holds_at_most(window):
    """A prompt of each length from 1 to 40 received whole, then 12 decode steps: the blocks held never exceed
    max_blocks_held_received, and some length reaches it."""
    manager = HybridKVCacheManager(256, BLOCK, True, [None, window])
    reached = False
    for prompt_len in range(1, 41):
        request = make_request(list(range(100, 100 + prompt_len)))
        assert manager.allocate_slots(request, 0, num_external_computed_tokens=prompt_len) is not None
        request.num_computed_tokens = prompt_len
        held = [manager.num_used_blocks]
        for token in range(12):
            request.append_output_token(token)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
            held.append(manager.num_used_blocks)
        num_tokens = prompt_len + 12
        assert max(held) <= manager.max_blocks_held_received(num_tokens) <= manager.max_blocks_held(num_tokens, 1)
        reached |= max(held) == manager.max_blocks_held_received(num_tokens)
        manager.free(request)
    assert reached, "no length holds what the count says: it over-counts"
    assert manager.num_used_blocks == 0
    manager.check_invariants()


def test_a_received_prompt_that_fits_near_capacity_is_accepted_and_one_block_more_is_refused(gemma3_dir):
    connector = FakeConnector()
    engine = _decode_engine(gemma3_dir, connector)
    assert len(engine.kv_cache_manager.groups) == 6
    request = engine.make_request("fits", list(range(10, 10 + PROMPT_LEN)), GREEDY, prefill_kv_address=ADDRESS)
    engine.add_request(request)
    engine.step()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.asked["fits"][1] == PROMPT_LEN
    connector.events.received["fits"] = (7, None)
    _run_to_end(engine)
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == MAX_TOKENS
    _assert_no_blocks_held(engine)

    longer = list(range(10, 10 + PROMPT_LEN + BLOCK))  # one more block in the full group: 27 > 26
    with pytest.raises(InvalidRequestError, match=f"needs up to {NUM_BLOCKS + 1} KV blocks across the model's "
                                                  f"layer groups but the whole cache holds {NUM_BLOCKS}: lower "
                                                  "max_tokens or start the engine with a larger KV cache"):
        engine.make_request("too-long", longer, GREEDY, prefill_kv_address=ADDRESS)
    with pytest.raises(InvalidRequestError, match="larger KV cache"):  # prefilled here, it would not fit
        engine.make_request("local", list(range(10, 10 + PROMPT_LEN)), GREEDY)
    _assert_no_blocks_held(engine)


def test_a_received_prompt_whose_transfer_fails_is_recomputed_in_chunks_that_fit(gemma3_dir):
    connector = FakeConnector()
    engine = _decode_engine(gemma3_dir, connector)
    request = engine.make_request("fails", list(range(10, 10 + PROMPT_LEN)), GREEDY, prefill_kv_address=ADDRESS)
    assert request.max_chunk_tokens == 1  # one token a step, as its decode steps: 3 blocks per sliding group
    engine.add_request(request)
    engine.step()
    connector.events.failed["fails"] = "peer died"
    _run_to_end(engine)
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == MAX_TOKENS
    assert request.num_external_computed_tokens == 0
    _assert_no_blocks_held(engine)
