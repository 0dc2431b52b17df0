"""Keep Python's cyclic garbage collector off the startup heap of a long-running process.

A router or engine imports transformers (and torch) and loads a tokenizer and a model: about a million
objects that live as long as the process. Every full (oldest-generation) collection walks all of them
again, ~150 ms on this project's 2-core machine, and the router's per-request garbage set one off every
few dozen requests: most of its CPU per request and all of its latency p99 (docs/results.md, router overhead).
`gc.freeze()` moves what exists now into a permanent generation that collections skip; what serving
allocates later is collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from future collections. Call it when start-up
    is over (models, tokenizers and sockets made), before serving."""
    gc.collect()
    gc.freeze()
