"""The CPU decode attention (kernels/torch_paged.py), grouped by length, equals attention computed
sequence by sequence, slot by slot; and group_by_length keeps its rule."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdserve.kernels import torch_paged
from tests.kernels.paged_data import assert_close, generator_for, make_paged_cache, randn

BLOCK = 16


def attention_per_sequence(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Independent reference: each sequence's slots looked up one by one, softmax written out, fp32."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for seq, length in enumerate(seq_lens.tolist()):
        positions = torch.arange(length)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        keys = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, num_heads, D]
        values = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", query[seq].float(), keys) * scale, dim=-1)
        out[seq] = torch.einsum("hl,lhd->hd", weights, values)
    return out


def run_both(context_lens, num_kv_heads, group, dtype, label, head_dim=64):
    """(plan, planned output, reference output) for one random batch."""
    gen = generator_for(label)
    cache = make_paged_cache(context_lens, num_kv_heads, head_dim, dtype, gen, block_size=BLOCK)
    query = randn((len(context_lens), num_kv_heads * group, head_dim), dtype, gen)
    scale = head_dim**-0.5
    plan = torch_paged.plan_decode(cache.block_tables, cache.seq_lens, BLOCK)
    out = torch_paged.decode_attention_planned(query, cache.key_cache, cache.value_cache, plan, scale)
    expected = attention_per_sequence(query, cache.key_cache, cache.value_cache, cache.block_tables,
                                      cache.seq_lens, scale)
    return plan, out, expected


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 4), (4, 1)])
def test_random_mixed_lengths_match_reference(seed, num_kv_heads, group, request):
    rng = random.Random(seed)
    lens = [rng.randint(1, 600) for _ in range(rng.randint(12, 40))]
    plan, out, expected = run_both(lens, num_kv_heads, group, torch.float32, request.node.name)
    assert len(plan.groups) > 1 and plan.restore is not None  # reordered groups are exercised
    assert out.dtype == torch.float32
    assert_close(out, expected, torch.float32)


def test_one_sequence(request):
    plan, out, expected = run_both([37], 3, 3, torch.float32, request.node.name)
    assert len(plan.groups) == 1 and plan.order is None and plan.groups[0].mask is None
    assert_close(out, expected, torch.float32)


def test_equal_lengths_run_as_one_group_without_mask_or_reorder(request):
    plan, out, expected = run_both([200] * 24, 3, 3, torch.float32, request.node.name)
    assert len(plan.groups) == 1 and plan.groups[0].mask is None
    assert plan.order is None and plan.restore is None
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("lens", [[16], [16] * 4, [64] * 5, [48, 64, 32, 64]], ids=["one block", "one block each",
                                                                               "equal", "mixed"])
def test_contexts_of_whole_blocks(lens, request):
    # every gathered block full: no position past a sequence's last block to leave out
    plan, out, expected = run_both(lens, 3, 3, torch.float32, request.node.name)
    assert all(group.span % BLOCK == 0 for group in plan.groups)
    assert_close(out, expected, torch.float32)


def test_one_group_of_unsorted_lengths_keeps_the_step_order(request):
    plan, out, expected = run_both([100, 110, 95, 105], 3, 3, torch.float32, request.node.name)
    assert len(plan.groups) == 1 and plan.order is None and plan.groups[0].mask is not None
    assert_close(out, expected, torch.float32)


def test_empty_sequences_get_zeros(request):
    # seq_len 0 marks a padding row: zeros, never NaN, wherever it sits in the step.
    plan, out, expected = run_both([0, 300, 17, 0, 64, 290], 3, 3, torch.float32, request.node.name)
    assert plan.any_empty
    assert torch.equal(out[[0, 3]], torch.zeros_like(out[[0, 3]]))
    assert_close(out, expected, torch.float32)


def test_all_sequences_empty(request):
    plan, out, _ = run_both([0, 0, 0], 3, 3, torch.float32, request.node.name)
    assert plan.any_empty and torch.equal(out, torch.zeros_like(out))


def test_a_plan_shared_by_layers_gives_each_layer_its_own_attention(request):
    # Every layer of a step runs the same plan, whose gather buffers they share (one per cache dtype):
    # layer after layer, and dtype after dtype, each result equals that of a plan of its own.
    gen = generator_for(request.node.name)
    lens = [300, 17, 64, 290, 1]
    layers = [make_paged_cache(lens, 3, 64, dtype, gen, block_size=BLOCK)
              for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    for layer in layers[1:]:
        layer.block_tables.copy_(layers[0].block_tables)
    plan = torch_paged.plan_decode(layers[0].block_tables, layers[0].seq_lens, BLOCK)
    for layer in layers + layers[::-1]:
        query = randn((len(lens), 9, 64), layer.key_cache.dtype, gen)
        own_plan = torch_paged.plan_decode(layer.block_tables, layer.seq_lens, BLOCK)
        shared = torch_paged.decode_attention_planned(query, layer.key_cache, layer.value_cache, plan, 0.125)
        alone = torch_paged.decode_attention_planned(query, layer.key_cache, layer.value_cache, own_plan, 0.125)
        assert torch.equal(shared, alone)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_caches(dtype, request):
    rng = random.Random(dtype.itemsize)
    lens = [rng.randint(1, 400) for _ in range(20)]
    plan, out, expected = run_both(lens, 3, 3, dtype, request.node.name)
    assert len(plan.groups) > 1 and out.dtype == dtype
    assert_close(out, expected, dtype)


def padding(lens: list[int], group: list[int]) -> int:
    longest = max(lens[i] for i in group)
    return sum(longest - lens[i] for i in group)


@pytest.mark.parametrize("seed", range(20))
def test_grouping_covers_every_sequence_once_and_keeps_the_padding_bound(seed):
    rng = random.Random(seed)
    lens = [rng.choice([0, rng.randint(1, 4000)]) if rng.random() < 0.1 else rng.randint(1, 600)
            for _ in range(rng.randint(1, 64))]
    max_padding, max_groups, min_padding = rng.choice([0.05, 0.25, 0.5]), rng.randint(1, 8), rng.choice([0, 256])
    groups = torch_paged.group_by_length(lens, max_padding, max_groups, min_padding)
    assert sorted(i for group in groups for i in group) == list(range(len(lens)))
    filled = [group for group in groups if any(lens[i] > 0 for i in group)]
    assert len(filled) <= max_groups
    assert all(lens[i] > 0 for group in filled for i in group)  # empty sequences only in their own group
    bounded = filled if len(filled) < max_groups else filled[:-1]  # the cap's last group takes the rest
    for group in bounded:
        assert padding(lens, group) <= max(max_padding * sum(lens[i] for i in group), min_padding)
    for longer, shorter in itertools.pairwise(groups):  # longest first
        assert min(lens[i] for i in longer) >= max(lens[i] for i in shorter)


def test_grouping_opens_a_group_only_when_the_bound_needs_it():
    # 100, 90 pad 10 <= 0.25 x 190; adding 50 pads 10 + 50 = 0.25 x 240, still within the bound.
    assert torch_paged.group_by_length([50, 100, 90], 0.25, 4, min_padding=0) == [[1, 2, 0]]
    # adding 40 would pad 10 + 60 > 0.25 x 230: a second group, unless the cap allows only one ...
    assert torch_paged.group_by_length([40, 100, 90], 0.25, 4, min_padding=0) == [[1, 2], [0]]
    assert torch_paged.group_by_length([40, 100, 90], 0.25, 1, min_padding=0) == [[1, 2, 0]]
    # ... or a padding of 70 tokens is allowed anyway.
    assert torch_paged.group_by_length([40, 100, 90], 0.25, 4, min_padding=70) == [[1, 2, 0]]


def test_equal_lengths_make_one_group_in_step_order():
    assert torch_paged.group_by_length([128] * 9) == [list(range(9))]


def test_empty_sequences_form_the_last_group():
    assert torch_paged.group_by_length([0, 50, 0, 50]) == [[1, 3], [0, 2]]


def test_grouping_refuses_no_groups():
    with pytest.raises(ValueError, match="max_groups must be at least 1"):
        torch_paged.group_by_length([1, 2], max_groups=0)


def test_group_padding_is_what_the_groups_read_beyond_their_contexts():
    from pdserve.kernels.length_groups import group_by_length, group_padding

    lens = [129, 150, 171, 192, 213, 235, 256, 277, 298, 319, 341, 362, 0, 385]
    groups = group_by_length(lens)
    assert group_padding(lens) == sum(max(lens[i] for i in g) * len(g) - sum(lens[i] for i in g) for g in groups
                                      if any(lens[i] for i in g)) > 0
    assert group_padding([300, 300, 300]) == 0 and group_padding([]) == 0 and group_padding([0, 5]) == 0
    assert group_padding([701, 101]) == 0  # two groups: 600 tokens of padding would cost more than a call
    assert group_padding([301, 101]) == 200  # one group: within 256 tokens


def test_the_planner_reads_the_length_groups_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys\nimport pdserve.kernels.length_groups, pdserve.planner.model.simulator\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
