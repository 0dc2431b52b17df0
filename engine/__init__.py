"""pdserve's inference runtime: config, loading, models, KV cache, scheduling, sampling."""

from engine.request import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
