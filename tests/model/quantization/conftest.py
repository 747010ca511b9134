"""Tiny float checkpoints wide enough for groups of 128, shared by the quantization tests."""

from __future__ import annotations

import pytest

from tests.conftest import build_checkpoint

# Inputs of 128 (hidden) and 256 (MLP) features: whole groups of 128.
SHAPE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def float_source(tmp_path_factory):
    """float_source(arch) -> a tiny checkpoint of `arch` (tests/conftest.py) 128 features wide."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}-128"), **SHAPE)
        return cache[arch]

    return get
