"""FP8 KV cache scales in checkpoints (compressed-tensors, ModelOpt, AutoFP8 names) load onto
each layer's attention; a cache in the model dtype ignores them, an fp8 one uses them."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferengine import LLM
from inferengine.errors import ModelLoadError
from tests.engine.test_fp8_kv_cache import agreement, argmax_per_position, prompts

LAYERS = 3  # the tiny qwen3


def with_scales(src, dst, scales: dict[str, float | list[float]]):
    """A copy of checkpoint `src` with the tensors `scales` (name -> value) added."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors |= {name: torch.tensor(value) for name, value in scales.items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def layer_scales(llm: LLM) -> list[tuple[float, float]]:
    model = llm.llm_engine.core.executor.worker.runner.model
    return [(layer.self_attn.attn.spec.k_scale, layer.self_attn.attn.spec.v_scale)
            for layer in model.model.layers]  # fmt: skip


def test_each_naming_lands_on_its_layer(tiny_checkpoint, tmp_path):
    scales = {
        "model.layers.0.self_attn.k_scale": 0.5,  # compressed-tensors
        "model.layers.0.self_attn.v_scale": 0.25,
        "model.layers.1.self_attn.k_proj.k_scale": [0.75],  # ModelOpt
        "model.layers.1.self_attn.v_proj.v_scale": [0.125],
        "model.layers.2.self_attn.kv_scale": 2.0,  # AutoFP8: both
        "model.layers.2.self_attn.q_scale": 3.0,  # fp8 queries: not ours, ignored
    }
    path = with_scales(tiny_checkpoint("qwen3"), tmp_path / "m", scales)
    llm = LLM(str(path), max_model_len=128, kv_cache_dtype="fp8")
    assert layer_scales(llm) == [(0.5, 0.25), (0.75, 0.125), (2.0, 2.0)]


def test_per_head_scales_take_the_largest(tiny_checkpoint, tmp_path):
    scales = {"model.layers.1.self_attn.k_proj.output_scale": [0.1, 0.4, 0.2]}
    path = with_scales(tiny_checkpoint("qwen3"), tmp_path / "m", scales)
    llm = LLM(str(path), max_model_len=128, kv_cache_dtype="fp8")
    assert layer_scales(llm) == [(1.0, 1.0), (pytest.approx(0.4), 1.0), (1.0, 1.0)]


def test_bad_scales_are_refused(tiny_checkpoint, tmp_path):
    path = with_scales(
        tiny_checkpoint("qwen3"), tmp_path / "m", {"model.layers.0.self_attn.k_scale": 0.0}
    )
    with pytest.raises(ModelLoadError, match="not a positive KV cache scale"):
        LLM(str(path), max_model_len=128)


def test_scales_are_used_by_fp8_only(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("qwen3")
    token_lists = prompts(7, lengths=(60, 30))
    plain = argmax_per_position(LLM(str(base), max_model_len=256), token_lists)

    def scaled(value: float):
        names = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(LAYERS) for w in "kv"]
        return with_scales(base, tmp_path / f"s{value}", dict.fromkeys(names, value))

    mild, crushing = scaled(0.5), scaled(1e-3)
    full_with_scales = LLM(str(crushing), max_model_len=256)
    assert argmax_per_position(full_with_scales, token_lists) == plain
    fp8 = argmax_per_position(LLM(str(mild), max_model_len=256, kv_cache_dtype="fp8"), token_lists)
    assert agreement(fp8, plain) >= 0.9
    # x / 0.001 saturates nearly every element: the scales reach the cache.
    saturated = LLM(str(crushing), max_model_len=256, kv_cache_dtype="fp8")
    assert agreement(argmax_per_position(saturated, token_lists), plain) < 0.8
