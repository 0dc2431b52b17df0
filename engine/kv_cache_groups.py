"""Which attention layers share a block table: for a model whose layers do not all have one sliding
window, groups of equally many layers of one attention kind (full, or sliding with window W). A pool
block holds one block of every layer of a group; layer i of each group uses the cache tensor's slot i."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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
