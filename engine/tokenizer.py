"""The model directory's tokenizer and chat template, through transformers."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.hub import cache_only, hub_failure, is_hub_id


# any one of them makes a directory hold a tokenizer (fast, sentencepiece, or a BPE vocabulary)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class TokenizerLoadError(ValueError):
    pass


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        # a hub id without a reachable hub: the local HF cache alone, at once (not after a minute of retries)
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=is_hub_id(model_dir) and cache_only())
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a missing/broken tokenizer
        if is_hub_id(model_dir):
            raise TokenizerLoadError(hub_failure(str(model_dir), "the tokenizer", exc)) from exc
        if not Path(model_dir).expanduser().is_dir():
            raise TokenizerLoadError(f"cannot load the tokenizer of {str(model_dir)!r}: no such directory, and "
                                     f"not a Hugging Face hub id (org/name): pass a model directory or a hub id"
                                     ) from exc
        if not any((Path(model_dir).expanduser() / name).is_file() for name in _TOKENIZER_FILES):
            raise TokenizerLoadError(f"{model_dir} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): copy the "
                                     f"tokenizer files of the model's repository into it") from exc
        detail = " ".join(str(exc).split())  # transformers' messages run over several lines
        raise TokenizerLoadError(
            f"cannot load the tokenizer of {model_dir} ({type(exc).__name__}: {detail}): the directory needs "
            "tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
        ) from exc
