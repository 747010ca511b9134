"""`load_tokenizer`: a checkpoint's Hugging Face tokenizer, for the API process (tokenize,
detokenize) and the engine core's grammar manager (llguidance)."""

from __future__ import annotations

from typing import Any

from inferengine.errors import ModelLoadError


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path} ({e}). Put tokenizer.json / tokenizer_config.json "
            "beside config.json, or pass --tokenizer with a folder that has them."
        ) from e
