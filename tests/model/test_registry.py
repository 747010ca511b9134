"""The registry's classes and the checkpoint room's architecture names stay one table:
`checkpoint/architecture.py` decides native or Transformers from names alone (before anything
loads), `model/registry.py` maps each native name to its class."""

from __future__ import annotations

import pytest
from torch import nn

from inferengine.checkpoint import architecture
from inferengine.checkpoint.architecture import (
    BUILTIN_ARCHITECTURES,
    choose_implementation,
    supported_architectures,
)
from inferengine.errors import ModelLoadError
from inferengine.model import registry


def test_every_builtin_name_has_a_class_and_every_class_a_name():
    assert set(registry._BUILTIN) == BUILTIN_ARCHITECTURES


def test_register_model_makes_a_name_native(monkeypatch):
    monkeypatch.setattr(architecture, "_registered", set())
    monkeypatch.setattr(registry, "_registered", {})
    config = {"architectures": ["MyModelForCausalLM"]}
    with pytest.raises(ModelLoadError, match="native implementation"):
        choose_implementation(config, "native")

    class MyModelForCausalLM(nn.Module):
        pass

    registry.register_model("MyModelForCausalLM", MyModelForCausalLM)
    assert choose_implementation(config, "native").native
    assert choose_implementation(config).native
    assert "MyModelForCausalLM" in supported_architectures()
    assert registry.resolve_model_class(config) is MyModelForCausalLM
