"""Hugging Face hub ids: telling one from a local path, and one-line reasons when fetching fails
(no network, no such repository, a gated one) that name the fix. Torch-free: the router uses it."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


def is_hub_id(model: str | Path) -> bool:
    """'org/name' that is not an existing path: the shape of a hub id (a local path is never one)."""
    text = str(model)
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).expanduser().exists()


def cache_only() -> bool:
    """True when a hub fetch should look in the local HF cache alone: HF_HUB_OFFLINE is set, or the hub's host
    name does not resolve (no network). Fetching then would only retry for about 50 s before failing."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except (OSError, UnicodeError):
        return True
    return False


def hub_failure(model: str, what: str, exc: BaseException) -> str:
    """Why `what` (e.g. "the model", "the tokenizer") of hub id `model` could not be fetched, and the fix."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    causes = _chain(exc)
    if any(isinstance(cause, GatedRepoError) for cause in causes):
        return (f"{model!r} is a gated model on the Hugging Face hub: accept its terms on huggingface.co and set "
                f"HF_TOKEN to a token of that account")
    if any(isinstance(cause, RepositoryNotFoundError) for cause in causes):
        return (f"the Hugging Face hub has no model {model!r} (or it is private: set HF_TOKEN): check the id, or "
                f"pass a local model directory")
    offline = any(isinstance(cause, (LocalEntryNotFoundError, ConnectionError)) for cause in causes) or any(
        "connect" in str(cause).lower() for cause in causes)
    if offline and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return (f"HF_HUB_OFFLINE is set and {what} of {model!r} is not in the local HF cache: unset HF_HUB_OFFLINE "
                f"to download it, or pass a local model directory")
    if offline:
        return (f"cannot reach the Hugging Face hub to fetch {what} of {model!r}, and it is not in the local HF "
                f"cache: connect this machine to the network, or pass a local model directory (a model fetched "
                f"before is used offline with HF_HUB_OFFLINE=1)")
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return (f"could not fetch {what} of {model!r} from the Hugging Face hub ({type(exc).__name__}: {first_line}): "
            f"check the id and the network, or pass a local model directory")


def _chain(exc: BaseException) -> list[BaseException]:
    """exc and its causes/contexts, outermost first."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain
