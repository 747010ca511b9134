"""Fixtures for the loader tests: tiny random Llama checkpoints, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.model.loader.tiny_gguf import build_hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Callable[[str], Path]:
    """`tiny_llama(variant)`: the folder of a tiny random HF Llama (built once per session)."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = build_hf_model(tmp_path_factory.mktemp(f"hf-{variant}"), variant)
        return built[variant]

    return get
