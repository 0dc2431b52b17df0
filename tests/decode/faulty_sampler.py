"""An engine whose sampler fails on cue, for the step-failure tests:

    python -m tests.decode.faulty_sampler decode --model DIR ...

It wraps `Sampler.__call__` so that a batch holding a request with seed FAULT_SEED raises, as a sampler
bug would, then runs the normal entry point.
"""

from __future__ import annotations

import sys

from pdserve.cli import main
from pdserve.engine.layers.sampler import Sampler

FAULT_SEED = 4242


def inject() -> None:
    sample = Sampler.__call__

    def faulty_call(self, logits, requests):
        if any(request.sampling_params.seed == FAULT_SEED for request in requests):
            raise RuntimeError(f"injected sampler fault (seed {FAULT_SEED})")
        return sample(self, logits, requests)

    Sampler.__call__ = faulty_call


if __name__ == "__main__":
    inject()
    sys.exit(main(sys.argv[1:]))
