"""Before any load: is the server there, which models does it serve, and which request fields does it
take (token-id prompts, ignore_eos, min_tokens, stream_options)? Each question is one 1-token request.

A server that cannot be reached, refuses the API key, or refuses a plain 1-token request is a
ServerCheckError (one line, before any load). A field it refuses (HTTP 400 or 422) is dropped, with a
note saying so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import aiohttp

from pdserve.bench.serve_client import RequestShape, build_payload, error_message
from pdserve.bench.serve_datasets import SampleRequest

REFUSED = (400, 422)
MODELS_TIMEOUT_S = 10.0
PROBE_TOKENS = 4
PROBE_TEXT = "Hi"


class ServerCheckError(ValueError):
    pass


@dataclass(frozen=True)
class ServedModel:
    id: str
    root: str | None  # where the server loaded it from, when it says (vLLM, pdserve)


async def served_models(session: aiohttp.ClientSession, base_url: str) -> list[ServedModel]:
    """GET /v1/models; a ServerCheckError that names the fix when the server is not there or refuses us."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as response:
            if response.status in (401, 403):
                raise ServerCheckError(f"{url} refused the API key (HTTP {response.status}): pass --api-key or set "
                                       "PDSERVE_API_KEY / OPENAI_API_KEY")
            if response.status != 200:
                raise ServerCheckError(f"{url} answered HTTP {response.status} ({await error_message(response)}): "
                                       "is --base-url an OpenAI-compatible server's root (without /v1)?")
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ServerCheckError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc or 'timed out'}): "
                               "start it, or fix --base-url") from exc
    except json.JSONDecodeError as exc:
        raise ServerCheckError(f"{url} did not answer JSON: is --base-url an OpenAI-compatible server?") from exc
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list):
        raise ServerCheckError(f"{url} answered without a model list: is --base-url an OpenAI-compatible server?")
    # a card without a string id names nothing to send; a root that is no string is no path to load from
    return [ServedModel(card["id"], card.get("root") if isinstance(card.get("root"), str) else None)
            for card in cards if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]]


async def _try(session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float) -> tuple[int, str]:
    """(HTTP status, error message or "") of one request read to its end."""
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return response.status, await error_message(response)
            await response.read()
            return 200, ""
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ServerCheckError(f"{url}: a 1-token request failed ({type(exc).__name__}: {exc or 'timed out'}): "
                               "is the server healthy?") from exc


async def supported_shape(session: aiohttp.ClientSession, url: str, shape: RequestShape, sample: SampleRequest,
                          timeout_s: float) -> tuple[RequestShape, list[str]]:
    """The request shape the server takes, starting from `shape` (what was asked) and dropping what it
    refuses; with a note for each field dropped."""
    # a short text, or the first few ids of a real prompt: too short to fill a KV block, so the probes
    # warm no prefix cache
    ids = sample.prompt_token_ids[:PROBE_TOKENS] if sample.prompt_token_ids else None
    probe = SampleRequest(PROBE_TEXT, None, 1, ids)
    status, message = await _try(session, url, build_payload(probe, shape), timeout_s)
    if status == 200:
        return shape, []
    plain = replace(shape, token_id_prompts=False, ignore_eos=False, min_tokens=False, include_usage=False)
    status, message = await _try(session, url, build_payload(probe, plain), timeout_s)
    if status != 200:
        raise ServerCheckError(f"{url} failed a plain 1-token request (HTTP {status}: {message}): check --model "
                               "and --endpoint, and that the server is healthy")
    notes = []
    steps = (("include_usage", "stream_options.include_usage; output tokens are counted with the tokenizer"),
             ("token_id_prompts", "prompts as token ids; sending their text"),
             ("ignore_eos", "ignore_eos; output lengths are up to the model"),
             ("min_tokens", "min_tokens; only ignore_eos and max_tokens are sent"))
    for field, consequence in steps:
        if not getattr(shape, field) or (field == "min_tokens" and not plain.ignore_eos):
            continue
        candidate = replace(plain, **{field: True})
        status, message = await _try(session, url, build_payload(probe, candidate), timeout_s)
        if status == 200:
            plain = candidate
        elif status in REFUSED:
            notes.append(f"the server refused {consequence} (HTTP {status}: {message})")
        else:
            raise ServerCheckError(f"{url} answered HTTP {status} to a 1-token request ({message}): is it healthy?")
    return plain, notes

