"""Turns what the user named (alias, folder, .gguf file, hub id) into a local model folder."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferengine import envs
from inferengine.config import LOAD_FORMATS
from inferengine.errors import ConfigError, ModelLoadError

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a folder with config.json (and weights unless load_format is dummy)
    load_format: str  # "safetensors" or "dummy"
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]


def resolve_model(
    model: str, load_format: str = "auto", revision: str | None = None
) -> ResolvedModel:
    if load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}."
        )
    path = _local_folder(model, revision, load_format)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(
            f"{path} has no config.json. Point --model at the folder that holds config.json and "
            "the *.safetensors weights (or at a .gguf file)."
        )
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{config_file} is not valid JSON ({e}); fix or re-download it."
        ) from e
    from inferengine.checkpoint.text_config import text_only_config

    hf_config = text_only_config(hf_config)  # a multimodal config read as its text model's
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    return ResolvedModel(path, fmt, hf_config, generation_config)


def _local_folder(model: str, revision: str | None, load_format: str) -> Path:
    from inferengine.checkpoint.aliases import ALIASES, resolve_alias

    if model.lower() in ALIASES:
        return resolve_alias(model.lower())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file, not a model folder or a .gguf file.")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(
            f"{model!r} is not a local folder, a .gguf file, a known alias "
            f"({', '.join(sorted(ALIASES))}) or a Hugging Face hub id like 'org/name'."
        )
    return _download(model, revision, load_format)


def _converted_gguf(gguf_path: Path) -> Path:
    from inferengine.checkpoint.cache_lock import folder_lock, remove_leftovers
    from inferengine.checkpoint.gguf import convert_gguf

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out_dir = envs.cache_dir() / "gguf" / f"{gguf_path.stem}-{digest}"
    if _converted(out_dir):  # never replaced once it keeps its GGUF: no lock to wait for
        return out_dir
    # One conversion at a time: a process that comes while another converts waits and takes its
    # folder, instead of replacing it under a process that is loading it.
    try:
        with folder_lock(out_dir):
            if _converted(out_dir):
                return out_dir
            remove_leftovers(out_dir)
            # Lean: float copies only of what the CPU's quantized path reads (the rest on
            # demand); also replaces a conversion without the GGUF.
            return convert_gguf(gguf_path, out_dir, lean=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the model cache {out_dir.parent} ({e}); point INFERENGINE_CACHE_DIR "
            "at a writable folder."
        ) from e


def _converted(folder: Path) -> bool:
    """`folder` holds a finished conversion that keeps its GGUF."""
    from inferengine.checkpoint.gguf_source import has_source

    return (folder / "config.json").exists() and has_source(folder)


def _download(repo_id: str, revision: str | None, load_format: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [p for p in _HUB_PATTERNS if not (load_format == "dummy" and "safetensors" in p)]
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=envs.hf_offline(),
            )
        )
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({reason}). Without network, "
            "download the model elsewhere and pass its local folder (config.json + "
            "*.safetensors), e.g. --model /models/my-model, or a .gguf file."
        ) from e
