"""Which prompt tokens of which layers cross the KV link.

A full-attention layer sends every token the decode engine asked for. A sliding-window layer sends only
the blocks that the window of the first decoded token reaches: the decode engine never reads the others.
Both engines compute this from the layout fingerprint they agreed on (docs/design/kv-link.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.control.schema import MAX_LAYERS


def window_start(next_position: int, window: int, block_size: int) -> int:
    """The first position of the first block that the window (next_position - window, next_position] reaches."""
    return max(0, next_position - window + 1) // block_size * block_size


@dataclass(frozen=True)
class LayerSpan:
    """Layers [layer_start, layer_end) that carry the same prompt tokens [start, end)."""

    layer_start: int
    layer_end: int
    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class LinkLayout:
    windows: tuple[int | None, ...]  # [num_layers]: each layer's sliding window, None for full attention
    block_size: int

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    def first_positions(self, num_prompt_tokens: int, skip_tokens: int) -> tuple[int, ...]:
        """[num_layers]: the first prompt position whose KV travels, for a transfer of prompt tokens
        [skip_tokens, num_prompt_tokens); the first decoded token sits at position num_prompt_tokens."""
        return tuple(skip_tokens if window is None
                     else max(skip_tokens, window_start(num_prompt_tokens, window, self.block_size))
                     for window in self.windows)

    @staticmethod
    def spans(firsts: Sequence[int], layer_start: int, layer_end: int, start: int, end: int) -> Iterator[LayerSpan]:
        """The tokens of [start, end) that layers [layer_start, layer_end) carry, as runs of neighbouring layers
        with the same first token; a layer that carries none of them is left out."""
        run_start, run_first = layer_start, None
        for layer in range(layer_start, layer_end + 1):
            first = max(start, firsts[layer]) if layer < layer_end else None
            if layer > run_start and first != run_first:
                if run_first < end:
                    yield LayerSpan(run_start, layer, run_first, end)
                run_start = layer
            run_first = first

    @staticmethod
    def num_tokens_per_layer(firsts: Sequence[int], end: int) -> list[int]:
        """[num_layers]: how many tokens each layer carries up to prompt position `end`."""
        return [max(0, end - first) for first in firsts]


def parse_windows(layer_windows: str) -> tuple[int | None, ...]:
    """LayoutFingerprint.layer_windows as windows (None: full attention). Each comma-separated entry is
    "full" or a window in tokens, optionally repeated: "4096*5,full" is five layers of 4096, then a full one.
    Raises ValueError naming a bad entry."""
    windows: list[int | None] = []
    for entry in layer_windows.split(","):
        value, star, count = entry.partition("*")
        good_value = value == "full" or value.isdigit() and int(value) > 0
        good_count = not star or count.isdigit() and int(count) > 0
        if not (good_value and good_count):
            raise ValueError(f"layer_windows entry {entry!r} is not 'full' or a window in tokens, "
                             f"optionally '*' a count of layers")
        repeat = int(count) if star else 1
        if len(windows) + repeat > MAX_LAYERS:
            raise ValueError(f"layer_windows describes more than {MAX_LAYERS} layers")
        windows.extend([None if value == "full" else int(value)] * repeat)
    return tuple(windows)


def format_windows(windows: Sequence[int | None]) -> str:
    """The inverse of parse_windows, with runs of equal windows written once: "4096*5,full"."""
    entries: list[str] = []
    index = 0
    while index < len(windows):
        run = 1
        while index + run < len(windows) and windows[index + run] == windows[index]:
            run += 1
        name = "full" if windows[index] is None else str(windows[index])
        entries.append(name if run == 1 else f"{name}*{run}")
        index += run
    return ",".join(entries)
