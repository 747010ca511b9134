"""Engine flags that are accepted but cannot work yet are refused at start-up, naming the flag."""

from __future__ import annotations

import pytest

from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.cli.main import build_parser, main
from inferengine.errors import ConfigError


@pytest.mark.parametrize("flag", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_sizes_above_one_are_refused(flag):
    """Refused before the model is resolved: the model name here does not exist anywhere."""
    cli = "--" + flag.replace("_", "-")
    with pytest.raises(ConfigError, match=f"{cli} 2 is not supported yet") as info:
        EngineArgs(model="/nonexistent/model", **{flag: 2}).create_engine_config()
    assert f"Run with {cli} 1" in info.value.message


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_parallel_size_flags_refused_by_the_cli(flag, capsys):
    """vLLM's flags parse (no "unrecognized argument"), then `serve` exits 1 saying why."""
    args = build_parser().parse_args(["serve", "/nonexistent/model", flag, "4"])
    assert getattr(args, flag[2:].replace("-", "_")) == 4
    assert main(["serve", "/nonexistent/model", flag, "4"]) == 1
    assert f"{flag} 4 is not supported yet" in capsys.readouterr().err


def test_revision_of_a_local_model_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="--revision v2 applies to a Hugging Face hub id"):
        EngineArgs(model=str(tiny_checkpoint("qwen3")), revision="v2").create_engine_config()
