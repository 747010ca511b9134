"""Triton selection helper."""

import importlib.util

import pytest
import torch

from inferengine.kernels import triton_utils


def test_triton_available_follows_device_and_interpreter(monkeypatch: pytest.MonkeyPatch):
    installed = importlib.util.find_spec("triton") is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_utils.triton_available() == installed
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_utils.triton_available() == (installed and torch.cuda.is_available())


def test_next_power_of_2():
    assert [triton_utils.next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65, 96)] == [
        1,
        1,
        2,
        4,
        64,
        128,
        128,
    ]
