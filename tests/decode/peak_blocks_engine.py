"""An engine that logs the most KV it has held at once, for the tests of sliding blocks freed on a decode engine:

    python -m tests.decode.peak_blocks_engine decode --model DIR ...

It wraps `EngineCore.__init__` so that every allocate_slots of the engine's KV cache manager is followed by a
look at the blocks in use, then runs the normal entry point. Each new peak is logged as
`peak KV layer-blocks: N` (N: blocks in use x the layers a block holds, so a cache with one block table and one
with a table per layer group compare).
"""

from __future__ import annotations

import logging
import sys

from pdserve.cli import main
from pdserve.engine.engine_core import EngineCore

log = logging.getLogger("tests.peak_blocks")
PEAK_LINE = "peak KV layer-blocks: "


def record_peaks() -> None:
    init = EngineCore.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        manager, layers_per_block = self.kv_cache_manager, self.runner.kv_cache.shape[0]
        allocate, peak = manager.allocate_slots, [0]

        def allocate_and_look(*call_args, **call_kwargs):
            blocks = allocate(*call_args, **call_kwargs)
            if manager.num_used_blocks * layers_per_block > peak[0]:
                peak[0] = manager.num_used_blocks * layers_per_block
                log.warning("%s%d", PEAK_LINE, peak[0])
            return blocks

        manager.allocate_slots = allocate_and_look

    EngineCore.__init__ = recording_init


def peak_in_log(text: str) -> int:
    """The last (largest) peak an engine's log reports; 0 if none."""
    peaks = [int(line.split(PEAK_LINE, 1)[1].split()[0]) for line in text.splitlines() if PEAK_LINE in line]
    return max(peaks, default=0)


if __name__ == "__main__":
    record_peaks()
    sys.exit(main(sys.argv[1:]))
