"""pdserve: prefill/decode-disaggregated LLM serving with its own inference runtime.

    from pdserve import LLM, SamplingParams     # the offline API, as vLLM's
    from pdserve import StructuredOutputsParams  # SamplingParams(structured_outputs=...), as vLLM's

Subpackages: engine (runtime), kernels, control (router <-> engine plane), kvtransfer (KV link),
prefill, decode, router, bench (`pdserve bench`, `sweep`), planner (`profile`, `plan`). `import pdserve`
alone loads neither torch nor pydantic: each name below is imported when first asked for.
"""

import importlib

# public name -> the module that defines it (LLM pulls in torch; the others, pydantic)
_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.control.sampling_params",
    "StructuredOutputsParams": "pdserve.control.sampling_params",
    "InvalidRequestError": "pdserve.control.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
