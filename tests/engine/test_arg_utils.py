"""Engine flags that are accepted but cannot work yet are refused at start-up, naming the flag."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

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


# ---- flags and INFERENGINE_<FLAG> defaults -----------------------------------------------


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_flags_become_engine_args_field_by_field():
    args = engine_parser().parse_args(
        [
            "some/model",
            "--max-model-len=64",
            "--no-enable-prefix-caching",
            "--dtype=bf16",
            "--kv-cache-memory=512MiB",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
            "--kv-offloading-size=1.5",
        ]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(
        model="some/model",
        max_model_len=64,
        enable_prefix_caching=False,
        dtype="bf16",
        kv_cache_memory=512 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        kv_offloading_size=1.5,
    )
    assert EngineArgs.from_cli_args(engine_parser().parse_args([])) == EngineArgs()


def test_environment_defaults_and_flags_over_them(monkeypatch):
    monkeypatch.setenv("INFERENGINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("INFERENGINE_ENABLE_PREFIX_CACHING", "off")
    monkeypatch.setenv("INFERENGINE_ENFORCE_EAGER", "TRUE")
    monkeypatch.setenv("INFERENGINE_KV_CACHE_MEMORY", "2GiB")
    monkeypatch.setenv("INFERENGINE_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("INFERENGINE_MODEL", "env/model")
    monkeypatch.setenv("INFERENGINE_SPECULATIVE_CONFIG", '{"method": "suffix"}')
    from_env = EngineArgs.from_cli_args(engine_parser().parse_args([]))
    assert (from_env.model, from_env.max_num_seqs, from_env.gpu_memory_utilization) == (
        "env/model",
        7,
        0.5,
    )
    assert (from_env.enable_prefix_caching, from_env.enforce_eager) == (False, True)
    assert from_env.kv_cache_memory == 2 << 30
    assert from_env.speculative_config == {"method": "suffix"}
    flags = ["cli/model", "--max-num-seqs", "3", "--enable-prefix-caching", "--no-enforce-eager"]
    from_flags = EngineArgs.from_cli_args(engine_parser().parse_args(flags))
    assert (from_flags.model, from_flags.max_num_seqs) == ("cli/model", 3)
    assert (from_flags.enable_prefix_caching, from_flags.enforce_eager) == (True, False)


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        (
            "INFERENGINE_MAX_NUM_SEQS",
            "many",
            "INFERENGINE_MAX_NUM_SEQS='many' is not a valid value",
        ),
        ("INFERENGINE_GPU_MEMORY_UTILIZATION", "most", "'most' is not a valid value"),
        ("INFERENGINE_KV_CACHE_MEMORY", "lots", "'lots' is not a size like 2GiB, 512MB"),
        (
            "INFERENGINE_SPECULATIVE_CONFIG",
            "{",
            "='{' is not a valid value (--speculative-config is not valid JSON",
        ),
    ],
)
def test_a_bad_environment_default_is_a_config_error_naming_it(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(words)):
        engine_parser()


def test_the_cli_reports_a_bad_environment_default_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("INFERENGINE_KV_CACHE_MEMORY", "lots")
    assert main(["serve", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INFERENGINE_KV_CACHE_MEMORY='lots' is not a valid value")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000000", 1_000_000), ("2GiB", 2 << 30), ("512MB", 512_000_000), ("1.5 kib", 1536)],
)
def test_sizes_take_si_and_binary_units(text, size):
    args = engine_parser().parse_args(["--kv-cache-memory", text])
    assert args.kv_cache_memory == size


@pytest.mark.parametrize("text", ["2 parsecs", "GiB", "-1GB"])
def test_sizes_without_a_number_or_unit_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args([f"--kv-cache-memory={text}"])
    assert "is not a size like 2GiB, 512MB or 1000000" in capsys.readouterr().err


# ---- EngineArgs -> EngineConfig ----------------------------------------------------------


def test_an_engine_config_from_defaults_on_the_cpu(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    config = EngineArgs(model=str(path), device="cpu").create_engine_config()
    assert config.device == "cpu" and config.enforce_eager  # no CUDA graphs on the CPU
    assert config.model_config.model_path == str(path)
    assert config.model_config.dtype == "float32"  # auto on the CPU
    assert config.model_config.tokenizer == str(path)
    assert config.model_config.max_model_len == 1024  # the checkpoint's context
    sc = config.scheduler_config
    assert (sc.max_model_len, sc.max_model_len_auto) == (1024, True)
    assert sc.max_num_batched_tokens == 2048  # the CPU's default budget
    assert (sc.max_num_seqs, sc.policy, sc.async_scheduling) == (256, "fcfs", True)
    cc = config.cache_config
    assert (cc.block_size, cc.enable_prefix_caching, cc.cache_dtype) == (16, True, "auto")
    assert config.speculative_config is None


def test_explicit_settings_reach_the_engine_config(tiny_checkpoint):
    config = EngineArgs(
        model=str(tiny_checkpoint("qwen3")),
        dtype="half",
        max_model_len=200,
        max_num_batched_tokens=300,
        block_size=32,
        scheduling_policy="priority",
        served_model_name="tiny",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    ).create_engine_config()
    assert config.model_config.dtype == "float16"
    assert config.model_config.name == "tiny"
    sc = config.scheduler_config
    assert (sc.max_model_len, sc.max_model_len_auto, sc.max_num_batched_tokens) == (200, False, 300)
    assert (config.cache_config.block_size, sc.policy) == (32, "priority")
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (
            {"dtype": "float8"},
            "--dtype must be one of auto, float32, bfloat16, float16; got 'float8'",
        ),
        ({"device": "tpu"}, "--device must be auto, cuda or cpu; got 'tpu'"),
        ({"model_impl": "onnx"}, "--model-impl must be one of"),
        ({"max_model_len": -5}, "--max-model-len must be at least 1, got -5"),
        ({"max_model_len": 0}, "--max-model-len must be at least 1, got 0"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be at least 1"),
        ({"max_num_seqs": 0}, "--max-num-seqs must be at least 1, got 0"),
        ({"block_size": 24}, "--block-size must be one of 8, 16, 32, 64, 128; got 24"),
        ({"kv_cache_dtype": "int4"}, "--kv-cache-dtype must be one of"),
        ({"gpu_memory_utilization": 1.5}, r"--gpu-memory-utilization must be in (0, 1], got 1.5"),
        ({"kv_offloading_size": -1.0}, "--kv-offloading-size is GiB of host memory, 0 or more"),
        ({"scheduling_policy": "lifo"}, "--scheduling-policy must be one of"),
        ({"speculative_config": "ngram"}, "--speculative-config is not valid JSON"),
        ({"speculative_config": "[1, 2]"}, "--speculative-config must be a JSON object"),
        ({"speculative_config": {"method": "ngram"}}, "needs num_speculative_tokens"),
        (
            {"kv_offloading_size": 1.0, "enable_prefix_caching": False},
            "--kv-offloading-size keeps cached prefixes, so it needs prefix caching",
        ),
        (
            {"kv_offloading_size": 1e6},
            "--kv-offloading-size 1000000.0 GiB is more than this machine's available host memory",
        ),
        ({"router_cpu_hit_weight": 1.0}, "--router-cpu-hit-weight set how requests are routed"),
        (
            {"router_cpu_hit_weight": 1.0, "data_parallel_size": 2},
            "--router-cpu-hit-weight prices prompt tokens found in a replica's CPU tier",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_flag(tiny_checkpoint, changes, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        EngineArgs(model=str(tiny_checkpoint("qwen3")), **changes).create_engine_config()


def test_a_draft_model_and_a_cpu_tier_are_refused_together(tiny_checkpoint):
    path = str(tiny_checkpoint("llama3-tied"))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    args = EngineArgs(model=path, speculative_config=spec, kv_offloading_size=0.1)
    with pytest.raises(ConfigError, match="--kv-offloading-size does not work with a draft model"):
        args.create_engine_config()
    config = EngineArgs(
        model=path, speculative_config=spec, max_model_len=96
    ).create_engine_config()
    draft = config.speculative_config.draft_model_config
    assert (draft.model_path, draft.max_model_len, draft.dtype) == (path, 96, "float32")


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_checkpoint, tmp_path):
    from tests.conftest import build_checkpoint

    target = str(tiny_checkpoint("llama3-tied"))
    draft = build_checkpoint("llama2-bias", tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"vocab_size": 400}))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="has a vocabulary of 400 tokens, the target 320"):
        EngineArgs(model=target, speculative_config=spec).create_engine_config()


# ---- generation config -------------------------------------------------------------------


def _with_generation_config(tiny_checkpoint, tmp_path, contents: dict) -> Path:
    """A copy of the tiny qwen3 checkpoint whose generation_config.json is `contents`."""
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen3"), model)
    (model / "generation_config.json").write_text(json.dumps(contents))
    return model


def test_the_models_sampling_defaults_are_kept_or_dropped(tiny_checkpoint, tmp_path):
    model = _with_generation_config(
        tiny_checkpoint, tmp_path, {"eos_token_id": [1, 7], "temperature": 0.6, "top_k": 20}
    )
    auto = EngineArgs(model=str(model)).create_engine_config().model_config.generation_config
    assert auto == {"eos_token_id": [1, 7], "temperature": 0.6, "top_k": 20}
    vllm = EngineArgs(model=str(model), generation_config="vllm").create_engine_config()
    assert vllm.model_config.generation_config == {"eos_token_id": [1, 7]}  # sampling keys gone


def test_sampling_defaults_from_another_folder(tiny_checkpoint, tmp_path):
    model = _with_generation_config(tiny_checkpoint, tmp_path, {"eos_token_id": 1, "top_p": 0.5})
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 99, "temperature": 0.3})
    )
    config = EngineArgs(model=str(model), generation_config=str(other)).create_engine_config()
    # the folder gives sampling keys only; the model keeps its own eos ids
    assert config.model_config.generation_config == {"eos_token_id": 1, "temperature": 0.3}


def test_a_bad_generation_config_is_refused_at_start_up(tiny_checkpoint, tmp_path):
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(ConfigError, match=r"no .*generation_config\.json\. Give auto"):
        EngineArgs(model=path, generation_config=str(tmp_path)).create_engine_config()
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config\.json is not valid JSON"):
        EngineArgs(model=path, generation_config=str(tmp_path)).create_engine_config()
    model = _with_generation_config(tiny_checkpoint, tmp_path, {"top_p": 0.0})
    with pytest.raises(ConfigError, match=r"the sampling defaults from .* are invalid"):
        EngineArgs(model=str(model)).create_engine_config()
