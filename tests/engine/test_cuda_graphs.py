"""Decode CUDA graphs: bucket choice, padding and static buffers, fallback to eager, and (on a GPU)
real captured graphs against the eager engine.

On CPU, DecodeGraphs(use_cuda_graphs=False) runs the captured function eagerly over the padded
static buffers: the same code path as a replay minus torch.cuda.graph.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_batch_sizes, context_buckets

BLOCK = 4  # tokens per KV block in these tests: short prompts already span several blocks
NUM_BLOCKS = 128  # a small KV cache: the tests clone and compare it
# fp32, padded vs unpadded batch: matmuls of another row count round differently, a few ulp apart (3 prompts
# padded to 4 differed by 8.1e-6 with the torch decode plan, 1.1e-5 with the native CPU kernel; a wrong row or
# position differs by O(1)).
FP32_TOLERANCE = 3e-5


def make_prompts(count: int, vocab_size: int, seed: int = 0, max_len: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def attach_emulated_graphs(llm: LLM, batch_sizes, table_widths) -> DecodeGraphs:
    runner = llm.engine.runner
    assert runner.decode_graphs is None, "a CPU runner captures no graphs by itself"
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.attn_backend, runner.model_config.vocab_size, runner.block_size, runner.device,
        batch_sizes, table_widths, use_cuda_graphs=False,
    )
    return runner.decode_graphs


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


TIE_GAP = 1e-3


def assert_same_outputs(ours, theirs, tolerance: float, allow_ties: bool = False) -> None:
    """Same tokens and top logprobs within tolerance. allow_ties: a request may diverge at a step
    where `theirs` had a near tie (top-2 logprobs within TIE_GAP); comparison of it stops there."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        a, b = a.outputs[0], b.outputs[0]
        for step, (lp_a, lp_b) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            if allow_ties and a.token_ids[step] != b.token_ids[step]:
                top2 = sorted(lp_b.values(), reverse=True)[:2]
                assert top2[0] - top2[1] < TIE_GAP, f"request {i} step {step}: {a.token_ids} != {b.token_ids}"
                break
            assert a.token_ids[step] == b.token_ids[step], f"request {i}: {a.token_ids} != {b.token_ids}"
            assert lp_a.keys() == lp_b.keys(), f"request {i} step {step}: top tokens differ"
            worst = max(abs(lp_a[t] - lp_b[t]) for t in lp_a)
            assert worst <= tolerance, f"request {i} step {step}: logprobs differ by {worst:.2e}"
        assert len(a.token_ids) == len(b.token_ids), f"request {i}: {len(a.token_ids)} vs {len(b.token_ids)} tokens"


def assert_idle(llm: LLM) -> None:
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()


# ---------------------------------------------------------------------------- which graphs exist


def test_capture_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(3) == (1, 2, 3)
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256
    assert capture_batch_sizes(100)[-2:] == (96, 100)  # max_num_seqs itself is captured
    assert capture_batch_sizes(10_000)[-1] == 512  # larger batches run eagerly
    for n in range(1, 257):  # up to 7 padding rows through 64, then under a quarter of the batch
        padded = next(s for s in sizes if s >= n)
        assert padded - n < (8 if n <= 64 else n / 4), (n, padded)
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)


def test_context_buckets_follow_the_decode_kernels_tiling():
    from pdserve.kernels.triton_decode_attention import MIN_PARTITION_SIZE, choose_partition_size

    assert context_buckets(300, 16) == (19,)  # short models: one width, unsplit
    assert context_buckets(2048, 16) == (32, 128)  # unsplit up to 512, then one split width
    widths = context_buckets(131072, 16)
    assert widths == (32, 512, 1024, 2048, 4096, 8192)
    # Every context gets a width whose partition size is at most twice what its own length would pick.
    for context in (1, 511, 512, 513, 5000, 8192, 9000, 40000, 131072):
        width = next(w for w in widths if w * 16 >= context)
        chosen = choose_partition_size(width * 16)
        assert chosen <= 2 * max(choose_partition_size(context), MIN_PARTITION_SIZE), (context, width)
    assert context_buckets(1000, 2048) == (1,)  # a block wider than the first bucket


def test_graph_for_picks_the_smallest_batch_and_narrowest_table():
    model, backend = torch.nn.Identity(), TorchPagedBackend(BLOCK)
    graphs = DecodeGraphs(model, backend, 8, BLOCK, torch.device("cpu"), (1, 2, 4, 8), (4, 16, 64),
                          use_cuda_graphs=False)
    assert len(graphs.graphs) == 12
    picked = graphs.graph_for(3, 17)
    assert (picked.batch_size, picked.num_table_blocks) == (4, 16)
    assert picked.context.decode_block_tables.shape == (4, 16) and picked.context.decode_block_tables.is_contiguous()
    assert graphs.graph_for(8, 256).num_table_blocks == 64
    assert not graphs.can_run(9, 10) and not graphs.can_run(1, 257) and not graphs.can_run(0, 1)
    with pytest.raises(ValueError, match="fits no captured graph"):
        graphs.graph_for(9, 10)
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(model, backend, 8, BLOCK, torch.device("cpu"), (1,), (4,))


def test_cpu_runner_captures_nothing(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", num_kv_blocks=NUM_BLOCKS)
    assert llm.engine.runner.decode_graphs is None
    assert llm.model_config.enforce_eager is False
    eager = LLM(model_factory("llama"), dtype="float32", num_kv_blocks=NUM_BLOCKS, enforce_eager=True)
    assert eager.model_config.enforce_eager and eager.engine.runner.decode_graphs is None


# ---------------------------------------------------------------------------- padded path == eager


@pytest.mark.parametrize("num_prompts", [1, 3, 5, 8])
def test_generation_through_padded_buffers_equals_eager(model_factory, num_prompts):
    model_dir = model_factory("llama")
    prompts = make_prompts(num_prompts, 1024, seed=num_prompts)
    eager = LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    expected = generate(eager, prompts)
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    graphs = attach_emulated_graphs(llm, (1, 2, 4, 8), (4, 16, 128))
    outputs = generate(llm, prompts)
    assert_same_outputs(outputs, expected, tolerance=FP32_TOLERANCE)
    # One prefill step, then 9 decode steps of all prompts, each through the padded batch size.
    padded_size = next(s for s in (1, 2, 4, 8) if s >= num_prompts)
    assert sum(graphs.replays.values()) == 9 and {size for size, _ in graphs.replays} == {padded_size}
    assert_idle(llm)


def test_qwen3_with_qk_norm_and_tied_embeddings_through_padded_buffers(model_factory):
    model_dir = model_factory("qwen3", tie_word_embeddings=True)
    prompts = make_prompts(3, 1024, seed=7)
    expected = generate(LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS), prompts)
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    graphs = attach_emulated_graphs(llm, (4,), (128,))
    assert_same_outputs(generate(llm, prompts), expected, tolerance=FP32_TOLERANCE)
    assert graphs.replays[(4, 128)] > 0
    assert_idle(llm)


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    # kv caches [layers, 2, num_blocks, block_size, kv_heads, head_dim] -> flat slot ids written
    changed = (before != after).any(dim=-1).any(dim=-1).any(dim=0).any(dim=0)  # [num_blocks, block_size]
    return set(changed.flatten().nonzero().flatten().tolist())


def test_every_step_matches_eager_and_padding_writes_no_kv(model_factory):
    """Drive the engine by hand: each step runs through the graph path and eagerly from the same
    KV cache. Decode-only steps that fit use a graph, their logits equal eager ones up to fp32 rounding and
    they write exactly the real rows' slots; mixed and oversized steps run eagerly."""
    llm = LLM(model_factory("llama"), dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
              max_num_batched_tokens=16)
    engine, runner = llm.engine, llm.engine.runner
    graphs = attach_emulated_graphs(llm, (1, 3), (4, 128))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = make_prompts(7, 1024, seed=3, max_len=40)
    arrivals = {0: prompts[:3], 4: prompts[3:5], 9: prompts[5:]}  # step -> new requests
    kinds: set[str] = set()
    for step in range(200):
        for i, prompt in enumerate(arrivals.get(step, [])):
            engine.add_request(engine.make_request(f"{step}-{i}", prompt, params))
        if not engine.has_work():
            break
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            continue
        num_seqs = len(plan.scheduled)
        decode_only = plan.num_decodes == num_seqs
        expect_graph = decode_only and num_seqs <= 3
        kinds.add(f"graph-{'padded' if num_seqs == 2 else 'exact'}" if expect_graph else
                  "decode-oversized" if decode_only else "mixed" if plan.num_decodes else "prefill")
        before = runner.kv_cache.clone()
        replays = sum(graphs.replays.values())
        inputs = runner.prepare(plan)
        logits = runner.step_logits(inputs)
        assert (sum(graphs.replays.values()) > replays) == expect_graph, f"step {step}: {num_seqs} seqs"
        if expect_graph:  # padding rows of the batch were reset, not left from an earlier step
            size = graphs.graph_for(num_seqs, inputs.max_seq_len).batch_size
            assert graphs.slot_mapping[num_seqs:size].eq(-1).all() and graphs.seq_lens[num_seqs:size].eq(0).all()
        written = _changed_slots(before, runner.kv_cache)
        assert written == set(inputs.context.slot_mapping.tolist()), f"step {step}: wrote other slots"
        graph_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        eager_logits = runner.step_logits(runner.prepare(plan), eager=True)
        # Not bit-equal: a padded batch runs matmuls of another row count, which round differently.
        torch.testing.assert_close(logits, eager_logits, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)
        torch.testing.assert_close(graph_cache, runner.kv_cache, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)
        result = runner.sampler(eager_logits, inputs.sampling_requests)
        sampled = {r.request_id: (t, None) for r, t in zip(inputs.sampling_requests, result.token_ids)}
        engine.scheduler.update_from_output(plan, sampled)
    assert not engine.has_work()
    assert {"graph-padded", "graph-exact", "mixed", "decode-oversized"} <= kinds, kinds
    assert_idle(llm)


def test_layer_hook_steps_run_eagerly(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    engine, runner = llm.engine, llm.engine.runner
    graphs = attach_emulated_graphs(llm, (1, 2, 4), (128,))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(2, 1024, seed=5)):
        engine.add_request(engine.make_request(str(i), prompt, params))
    engine.step()  # prefill both
    plan = engine.scheduler.schedule()
    assert plan.num_decodes == len(plan.scheduled) == 2
    layers: list[int] = []
    sampled = runner.execute(plan, on_layer_stored=layers.append).sampled
    assert layers == list(range(runner.model_config.num_layers))
    assert sum(graphs.replays.values()) == 0
    engine.scheduler.update_from_output(plan, sampled)
    while engine.has_work():
        engine.step()
    assert sum(graphs.replays.values()) > 0  # later steps (no hook) use the graphs
    assert_idle(llm)


def test_triton_decode_kernel_ignores_padding_rows_and_table_width():
    """What a replay relies on, checked on the Triton kernel itself (interpreter on CPU): padding rows
    (seq_len 0) give zeros, and real rows give the same output whether the table is the step's own
    or a wider, split-K bucket with stale entries past each sequence."""
    from pdserve.kernels.triton_utils import INTERPRET

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU")
    from pdserve.kernels.triton_decode_attention import choose_partition_size, paged_decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    num_blocks, block, kv_heads, heads, dim = 40, 16, 2, 4, 32
    key_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(device)
    value_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(device)
    seq_lens = torch.tensor([5, 33, 17], dtype=torch.int32)
    tables = torch.tensor([[3, 0, 0], [7, 8, 9], [1, 2, 0]], dtype=torch.int32)
    query = torch.randn(3, heads, dim, generator=gen)
    own = paged_decode_attention(query.to(device), key_cache, value_cache, tables.to(device),
                                 seq_lens.to(device), 0.17)
    width = 64  # 1024 positions: split-K with two partitions
    assert choose_partition_size(width * block) < width * block
    wide = torch.randint(0, num_blocks, (4, width), dtype=torch.int32, generator=gen)  # stale entries
    wide[:3, :3] = tables
    padded_lens = torch.tensor([5, 33, 17, 0], dtype=torch.int32)
    padded_query = torch.cat((query, torch.randn(1, heads, dim, generator=gen)))
    out = paged_decode_attention(padded_query.to(device), key_cache, value_cache, wide.to(device),
                                 padded_lens.to(device), 0.17)
    torch.testing.assert_close(out[:3], own, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


_TRITON_ENGINE_SCRIPT = """
import random, sys
from pdserve import LLM, SamplingParams
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve import kernels
assert kernels.kernel_backend("cpu") == "triton"
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(5, 1024) for _ in range(rng.randint(1, 30))]} for _ in range(3)]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
eager = LLM(sys.argv[1], dtype="float32", block_size=16, num_kv_blocks=64).generate(prompts, params)
assert [o.outputs[0].token_ids for o in eager] == EXPECTED, "Triton kernels differ from the torch ones"
llm = LLM(sys.argv[1], dtype="float32", block_size=16, num_kv_blocks=64)
runner = llm.engine.runner
runner.decode_graphs = DecodeGraphs(runner.model, runner.attn_backend, 1024, 16, runner.device, (1, 4), (2, 64),
                                    use_cuda_graphs=False)
for ours, theirs in zip(llm.generate(prompts, params), eager):
    ours, theirs = ours.outputs[0], theirs.outputs[0]
    assert ours.token_ids == theirs.token_ids, (ours.token_ids, theirs.token_ids)
    for a, b in zip(ours.logprobs, theirs.logprobs):
        assert max(abs(a[t] - b[t]) for t in a) < 1e-4, (a, b)
assert llm.kv_cache_manager.num_used_blocks == 0
print(sorted(runner.decode_graphs.replays.items()))
"""


def test_padded_path_with_the_triton_kernels(model_factory):
    """The kernels a GPU run uses (Triton store_kv skipping slot -1, decode attention over a padded,
    split-K-wide table, fused add+RMSNorm, rotary), here under the Triton interpreter in a fresh
    process: the same tokens as the torch kernels in this process, eagerly and through the graph path."""
    from tests.kernels.subprocess_env import run_python

    import random

    from pdserve import LLM, SamplingParams

    model_dir = model_factory("llama")
    rng = random.Random(0)  # the script's prompts
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1024) for _ in range(rng.randint(1, 30))]} for _ in range(3)]
    torch_kernels = LLM(model_dir, dtype="float32", block_size=16, num_kv_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    expected = [o.outputs[0].token_ids for o in torch_kernels]
    code = _TRITON_ENGINE_SCRIPT.replace("sys.argv[1]", repr(model_dir)).replace("EXPECTED", repr(expected))
    result = run_python(code, timeout=300, PDSERVE_KERNELS="triton", TRITON_INTERPRET="1")
    assert result.returncode == 0, f"child failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    # 3 prompts -> batch 4; short contexts use the 2-block table, longer ones the 64-block (split-K) one
    assert result.stdout.strip() == "[((4, 2), 2), ((4, 64), 3)]"


# ---------------------------------------------------------------------------- the GPU benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the real benchmark")
def test_gpu_engine_bench_without_cuda_explains_and_exits_zero(capsys):
    from tests.experiments import load_experiment

    gpu_engine = load_experiment("gpu_engine")

    assert gpu_engine.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_engine_bench_table():
    from tests.experiments import load_experiment

    format_results = load_experiment("gpu_engine").format_results

    seconds = {("eager", 1): 2.0, ("graphs", 1): 0.5, ("eager", 32): 4.0, ("graphs", 32): 2.0}
    table = format_results(seconds, [1, 32], 100)
    rows = table.splitlines()
    assert rows[1].split() == ["1", "50.0", "200.0", "20.00", "5.00", "4.00x"]
    assert rows[2].split() == ["32", "800.0", "1600.0", "40.00", "20.00", "2.00x"]


# ---------------------------------------------------------------------------- real graphs (GPU only)


def _skip_without_compiled_triton() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pdserve.kernels.triton_utils import INTERPRET

    assert not INTERPRET, ("a CUDA device is present but triton interprets in this process: something set "
                           "TRITON_INTERPRET=1 for the whole suite, so no GPU test here would run compiled kernels")


@pytest.mark.parametrize("num_prompts", [1, 3, 6])
def test_cuda_graphs_match_eager_on_gpu(model_factory, num_prompts):
    _skip_without_compiled_triton()
    model_dir = model_factory("llama")
    prompts = make_prompts(num_prompts, 1024, seed=11)
    common = {"dtype": "float32", "device": "cuda", "block_size": 16, "num_kv_blocks": 256}
    eager = LLM(model_dir, enforce_eager=True, **common)
    assert eager.engine.runner.decode_graphs is None
    expected = generate(eager, prompts, max_tokens=16)
    llm = LLM(model_dir, **common)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.use_cuda_graphs
    assert all(g.cuda_graph is not None for g in graphs.graphs.values())
    outputs = generate(llm, prompts, max_tokens=16)
    assert_same_outputs(outputs, expected, tolerance=1e-4, allow_ties=True)
    padded = next(s for s in graphs.batch_sizes if s >= num_prompts)
    assert any(size == padded for size, _ in graphs.replays), graphs.replays
    assert_idle(llm)


def test_cuda_graph_replay_equals_padded_eager_run_on_gpu(model_factory):
    """A replay and an eager run of the same padded buffers give the same logits and KV."""
    _skip_without_compiled_triton()
    llm = LLM(model_factory("llama"), dtype="float32", device="cuda", block_size=16, num_kv_blocks=256,
              enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    runner.decode_graphs = graphs = DecodeGraphs(
        runner.model, runner.attn_backend, runner.model_config.vocab_size, runner.block_size, runner.device,
        (1, 4, 8), (8, 32))
    graphs.capture()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(3, 1024, seed=13)):
        engine.add_request(engine.make_request(str(i), prompt, params))
    engine.step()  # prefill
    while engine.has_work():
        plan = engine.scheduler.schedule()
        before = runner.kv_cache.clone()
        logits = runner.step_logits(runner.prepare(plan)).clone()
        replayed_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        inputs = runner.prepare(plan)
        padded = graphs.run(inputs.input_ids, inputs.positions, inputs.context, inputs.max_seq_len, replay=False)
        padded = padded.index_select(0, inputs.logits_indices)
        torch.testing.assert_close(logits, padded, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(replayed_cache, runner.kv_cache, atol=1e-5, rtol=1e-5)
        engine.scheduler.update_from_output(plan, runner.execute(plan).sampled)
    assert graphs.replays[(4, 8)] > 0
    assert_idle(llm)


def test_bf16_generation_with_cuda_graphs_on_gpu(model_factory):
    _skip_without_compiled_triton()
    model_dir = model_factory("qwen3")
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=512, max_num_seqs=16)
    outputs = generate(llm, make_prompts(20, 1024, seed=17, max_len=60), max_tokens=24)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert sum(llm.engine.runner.decode_graphs.replays.values()) > 0
    assert_idle(llm)
