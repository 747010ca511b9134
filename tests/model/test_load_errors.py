"""Every bad model input fails with a message that says what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from inferengine import LLM
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError, ModelLoadError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no config.json.*Point --model at the folder"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


def test_unknown_architecture_lists_supported(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path))
    message = str(info.value)
    assert "FancyNewForCausalLM" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    assert "register_model" in message


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2"), tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt.*Download it again"):
        LLM(str(path))


def test_checkpoint_missing_tensors(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_checkpoint("qwen2"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors.*down_proj"):
        LLM(str(path))


def test_unknown_dtype(tiny_checkpoint):
    with pytest.raises(ConfigError, match="--dtype must be one of auto, float32, bfloat16"):
        LLM(str(tiny_checkpoint("qwen2")), dtype="float8")


def test_hub_id_without_network_names_the_local_alternative(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"cannot fetch 'someorg/some-model'.*local folder"):
        EngineArgs(model="someorg/some-model").create_engine_config()


def test_not_a_path_alias_or_hub_id():
    with pytest.raises(ModelLoadError, match=r"not a local folder, a .gguf file, a known alias"):
        EngineArgs(model="./does/not/exist").create_engine_config()


def test_max_model_len_that_cannot_fit_names_the_flag(tiny_checkpoint):
    with pytest.raises(ConfigError, match="Lower --max-model-len to 144 or less"):
        LLM(str(tiny_checkpoint("qwen2")), max_model_len=1024, num_gpu_blocks_override=10)
