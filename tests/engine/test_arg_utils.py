"""Engine flags that are accepted but cannot work yet are refused at start-up, naming the flag."""

from __future__ import annotations

import pytest

from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.cli.main import build_parser, main
from inferengine.errors import ConfigError


@pytest.mark.parametrize("flag", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_sizes_below_one_are_refused(flag):
    """Refused before the model is resolved: the model name here does not exist anywhere."""
    cli = "--" + flag.replace("_", "-")
    with pytest.raises(ConfigError, match=f"{cli} must be at least 1, got 0"):
        EngineArgs(model="/nonexistent/model", **{flag: 0}).create_engine_config()


def test_tensor_parallel_size_must_divide_the_heads(tiny_checkpoint):
    """qwen3 has 8 attention heads and 1 KV head: 3 ranks cannot split them."""
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(ConfigError, match=r"does not divide the model's 8 attention heads") as e:
        EngineArgs(model=path, tensor_parallel_size=3).create_engine_config()
    assert "use one of [1, 2, 4, 8]" in e.value.message
    config = EngineArgs(model=path, tensor_parallel_size=4, pipeline_parallel_size=3)
    assert config.create_engine_config().parallel_config.world_size == 12


def test_more_pipeline_stages_than_layers_are_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 4 is more than the model's 3"):
        EngineArgs(
            model=str(tiny_checkpoint("qwen3")), pipeline_parallel_size=4
        ).create_engine_config()


def test_a_draft_model_with_pipeline_stages_is_refused(tiny_checkpoint):
    path = str(tiny_checkpoint("llama3-tied"))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="a draft model cannot run with --pipeline-parallel"):
        EngineArgs(
            model=path, pipeline_parallel_size=2, speculative_config=spec
        ).create_engine_config()


def test_parallel_size_flags_parse_like_vllms(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    args = build_parser().parse_args(
        ["serve", path, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]
    )
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert main(["serve", path, "--tensor-parallel-size", "3"]) == 1


def test_revision_of_a_local_model_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="--revision v2 applies to a Hugging Face hub id"):
        EngineArgs(model=str(tiny_checkpoint("qwen3")), revision="v2").create_engine_config()


def test_a_max_model_len_past_the_models_context_is_refused(tiny_checkpoint):
    """Positions past max_position_embeddings have no rotary row: refused at start-up, not an
    IndexError in the engine process mid-generation."""
    path = str(tiny_checkpoint("qwen3"))
    context = EngineArgs(model=path).create_engine_config().model_config.max_model_len
    assert EngineArgs(model=path, max_model_len=context).create_engine_config()
    with pytest.raises(ConfigError, match=f"longer than the model's context \\({context} "):
        EngineArgs(model=path, max_model_len=context + 1).create_engine_config()
