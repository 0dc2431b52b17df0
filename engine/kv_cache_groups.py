"""Which attention layers share a block table: for a model whose layers do not all have one sliding
window, groups of equally many layers of one attention kind (full, or sliding with window W). A pool
block holds one block of every layer of a group; layer i of each group uses the cache tensor's slot i.
CacheLayers maps a model layer to its slot and block table, with or without groups (the KV link's copies)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A request's block ids as a KV cache manager gives them (get_block_ids): one table, or one per layer group.
BlockIds = list[int] | tuple[list[int], ...]


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]

    @property
    def layers_per_group(self) -> int:  # the cache tensor's slots; every group has this many layers
        return len(self.groups[0].layer_ids)

    @property
    def windows(self) -> list[int | None]:
        return [group.sliding_window for group in self.groups]

    def group_of_layer(self) -> tuple[int, ...]:  # [num_layers] group index of each layer
        return self._per_layer(lambda group_index, slot: group_index)

    def slot_of_layer(self) -> tuple[int, ...]:  # [num_layers] cache slot of each layer
        return self._per_layer(lambda group_index, slot: slot)

    def _per_layer(self, pick) -> tuple[int, ...]:
        values = {layer: pick(index, slot) for index, group in enumerate(self.groups)
                  for slot, layer in enumerate(group.layer_ids)}
        return tuple(values[layer] for layer in range(len(values)))


def group_layers_by_window(windows: Sequence[int | None]) -> KVCacheGroups | None:
    """Layer groups for layers with these windows (None: full attention), full layers first; None when every
    layer has the same window, so one block table serves them all. Each kind's layers split into groups of
    the greatest common divisor of the kinds' layer counts."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) <= 1:
        return None
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    order = sorted(kinds, key=lambda window: -1 if window is None else window)
    return KVCacheGroups(tuple(
        KVCacheGroup(window, tuple(kinds[window][start:start + size]))
        for window in order for start in range(0, len(kinds[window]), size)
    ))


@dataclass(frozen=True)
class LayerRun:
    """Model layers [layer_start, layer_end), kept in cache slots [slot, slot + their number) and read
    through block table `group`."""

    layer_start: int
    layer_end: int
    group: int
    slot: int

    @property
    def slot_end(self) -> int:
        return self.slot + self.layer_end - self.layer_start


class CacheLayers:
    """Where each model layer's KV sits in an engine's cache: its slot in the cache tensor and its layer
    group's block table (one table for every layer when the cache has no groups). The KV link's readers and
    writers copy through it."""

    def __init__(self, num_layers: int, groups: KVCacheGroups | None = None) -> None:
        self.num_layers = num_layers
        self.groups = groups
        self._group = groups.group_of_layer() if groups is not None else (0,) * num_layers
        self._slot = groups.slot_of_layer() if groups is not None else tuple(range(num_layers))
        if len(self._group) != num_layers:
            raise ValueError(f"the layer groups cover {len(self._group)} layers, the model has {num_layers}")

    @classmethod
    def of_cache(cls, num_slots: int, groups: KVCacheGroups | None) -> CacheLayers:
        """The layers of a cache tensor with num_slots layer slots (its first dimension) and these groups."""
        num_layers = num_slots if groups is None else sum(len(group.layer_ids) for group in groups.groups)
        return cls(num_layers, groups)

    @property
    def num_tables(self) -> int:
        return 1 if self.groups is None else len(self.groups.groups)

    def runs(self, layer_start: int, layer_end: int) -> list[LayerRun]:
        """Layers [layer_start, layer_end) as runs of neighbouring layers of one group at neighbouring slots."""
        runs: list[LayerRun] = []
        for layer in range(layer_start, layer_end):
            group, slot = self._group[layer], self._slot[layer]
            last = runs[-1] if runs else None
            if last is not None and last.group == group and last.slot_end == slot:
                runs[-1] = LayerRun(last.layer_start, layer + 1, group, last.slot)
            else:
                runs.append(LayerRun(layer, layer + 1, group, slot))
        return runs

    def tables(self, block_ids: BlockIds) -> tuple[list[int], ...]:
        """A request's block ids as one table per group: a KV cache manager's get_block_ids (a list, or a
        tuple of lists for a cache with layer groups)."""
        tables = tuple(map(list, block_ids)) if isinstance(block_ids, tuple) else (list(block_ids),)
        if len(tables) != self.num_tables:
            raise ValueError(f"{len(tables)} block tables for a cache of {self.num_tables}")
        return tables
