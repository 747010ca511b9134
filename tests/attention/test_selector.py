"""Backend selection at start-up: a shape the Triton kernels cannot run takes the torch reference
under `auto` and is refused under an explicit `triton`, before any request arrives."""

import pytest
import torch

from inferengine.attention import selector
from inferengine.attention.autotune import AttentionShape
from inferengine.errors import ConfigError


def shape(head_dim: int) -> AttentionShape:
    return AttentionShape(8, 2, head_dim, 16, torch.bfloat16)


@pytest.fixture
def cuda_with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend a CUDA device with Triton is present: only the choice is under test."""
    monkeypatch.setattr(selector, "_triton_usable", lambda device: device == "cuda")


@pytest.mark.parametrize("head_dim", [8, 16, 80, 96, 112, 192, 256])
def test_auto_takes_triton_for_every_head_dim_it_has_tiles_for(cuda_with_triton, head_dim):
    assert selector.get_attention_backend("auto", "cuda", shape(head_dim)).name == "triton"


def test_auto_falls_back_to_torch_past_the_kernels_head_dims(cuda_with_triton, monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(selector.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    backend = selector.get_attention_backend("auto", "cuda", shape(512))
    assert backend.name == "torch"
    assert any("head dim 512" in w for w in warnings)


def test_explicit_triton_past_the_kernels_head_dims_is_refused(cuda_with_triton):
    with pytest.raises(ConfigError, match=r"head dim 512.*--attention-backend auto"):
        selector.get_attention_backend("triton", "cuda", shape(512))


def test_benchmark_leaves_out_triton_where_it_cannot_run(cuda_with_triton):
    assert "triton" in selector.usable_backends("cuda", shape(128))
    assert "triton" not in selector.usable_backends("cuda", shape(512))
