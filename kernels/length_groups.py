"""How the CPU decode attention (kernels.torch_paged) groups a step's sequences by length, and the padding that
costs. No torch here: `pdserve plan` prices the same padding in its simulator."""

from __future__ import annotations

# Decode groups: sequences of similar length share one gather and one SDPA, so a step's attention costs
# about the sum of its contexts rather than batch x its longest context (docs/results.md, "Engine
# features", has the measurements behind these numbers).
MAX_PADDING_FRACTION = 0.1  # a group's padding stays within this fraction of its real tokens,
MIN_PADDING_TOKENS = 256  # or within this many tokens (a group costs ~ as much as this many padded tokens)
MAX_DECODE_GROUPS = 6  # attention calls per layer at most (plus one for empty sequences, if any)


def group_by_length(
    seq_lens: list[int],
    max_padding: float = MAX_PADDING_FRACTION,
    max_groups: int = MAX_DECODE_GROUPS,
    min_padding: int = MIN_PADDING_TOKENS,
) -> list[list[int]]:
    """Split a decode step's sequences (by index) into groups that each run as one attention call
    padded to the group's longest context.

    Rule: take the sequences longest first (equal lengths in step order). The next sequence joins the
    current group unless that would make the group's padding, sum(longest - length), exceed both
    max_padding x the group's real tokens, sum(length), and min_padding; then it opens a new group
    (a group costs an attention call: a few hundred padded tokens are cheaper). Once max_groups
    groups are open, the last one takes every remaining non-empty sequence (the shortest), whatever its
    padding. Sequences of length 0 attend to nothing: they form one more group of their own, last.
    Every index is in exactly one group; equal lengths make one group.
    """
    if max_groups < 1:
        raise ValueError(f"max_groups must be at least 1, got {max_groups}")
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    filled = [i for i in order if seq_lens[i] > 0]
    groups, start = [], 0
    for size in length_group_sizes([seq_lens[i] for i in filled], max_padding, max_groups, min_padding):
        groups.append(filled[start:start + size])
        start += size
    empty = [i for i in order if seq_lens[i] == 0]
    return groups + [empty] if empty else groups


def length_group_sizes(
    lengths: list[int],  # non-empty, longest first
    max_padding: float = MAX_PADDING_FRACTION,
    max_groups: int = MAX_DECODE_GROUPS,
    min_padding: int = MIN_PADDING_TOKENS,
) -> list[int]:
    """group_by_length's rule on lengths already in its order: how many of them each group takes."""
    sizes: list[int] = []
    longest = real = count = 0  # of the last group
    for length in lengths:
        real += length
        allowed = max_padding * real  # (the plan's simulator calls this once per decode run: no max() call)
        if count and (len(sizes) + 1 == max_groups or longest * (count + 1) - real <= (
                allowed if allowed > min_padding else min_padding)):
            count += 1
        else:
            if count:
                sizes.append(count)
            longest = real = length
            count = 1
    if count:
        sizes.append(count)
    return sizes


def group_padding(seq_lens: list[int]) -> int:
    """The tokens a decode step reads beyond its sequences' contexts: each of group_by_length's groups is
    padded to its longest (what `pdserve plan` prices for this backend)."""
    lengths = sorted((n for n in seq_lens if n > 0), reverse=True)
    padding = start = 0
    for size in length_group_sizes(lengths):
        padding += lengths[start] * size - sum(lengths[start:start + size])
        start += size
    return padding
