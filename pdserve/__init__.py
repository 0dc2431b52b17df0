"""pdserve: prefill/decode-disaggregated LLM serving with its own inference runtime.

    from pdserve import LLM, SamplingParams     # the offline API, as vLLM's
    from pdserve import StructuredOutputsParams  # SamplingParams(structured_outputs=...), as vLLM's

Subpackages: engine (runtime), kernels, control (router <-> engine plane), kvtransfer (KV link),
prefill, decode, router, bench (`pdserve bench`, `sweep`), planner (`profile`, `plan`). `import pdserve`
alone loads no torch.
"""

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "InvalidRequestError"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
