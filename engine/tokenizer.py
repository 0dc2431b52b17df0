"""The model directory's tokenizer and chat template, through transformers."""

from __future__ import annotations

from pathlib import Path


class TokenizerLoadError(ValueError):
    pass


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a missing/broken tokenizer
        raise TokenizerLoadError(
            f"cannot load the tokenizer of {model_dir} ({type(exc).__name__}: {exc}): the directory needs "
            "tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
        ) from exc
