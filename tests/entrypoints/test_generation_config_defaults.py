"""The model's generation_config.json sets the sampling defaults (`--generation-config`): they
reach the sampler through `LLM`, and `vllm` or a folder replace them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from inferengine import LLM, SamplingParams
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError
from inferengine.sampling_params import sampling_defaults


def _with_generation_config(src: Path, dest: Path, **values) -> Path:
    shutil.copytree(src, dest)
    gen_file = dest / "generation_config.json"
    config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    gen_file.write_text(json.dumps(config | values))
    return dest


@pytest.fixture(scope="module")
def greedy_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    """A tiny checkpoint whose generation_config.json asks for greedy decoding, 6 tokens."""
    dest = tmp_path_factory.mktemp("gen") / "greedy"
    return _with_generation_config(
        tiny_checkpoint("llama3-tied"), dest, temperature=0.0, max_new_tokens=6
    )


def _defaults(folder: Path, choice: str = "auto") -> dict:
    args = EngineArgs(model=str(folder), max_model_len=128, generation_config=choice)
    return sampling_defaults(args.create_engine_config().model_config.generation_config)


def test_generation_config_reaches_the_sampler(greedy_folder):
    llm = LLM(str(greedy_folder), max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 6)
    prompts = ["hello world", "the cat sat"]
    unset = llm.generate(prompts, use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in unset] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) == 6 for o in unset)  # max_new_tokens (no EOS here)
    # Given params win whole: SamplingParams() is vLLM's 1.0 / 16 tokens.
    explicit = llm.generate(prompts[0], SamplingParams(seed=1), use_tqdm=False)[0]
    assert len(explicit.outputs[0].token_ids) == 16


def test_vllm_ignores_the_file_and_a_folder_replaces_it(greedy_folder, tmp_path):
    assert _defaults(greedy_folder) == {"temperature": 0.0, "max_tokens": 6}
    assert _defaults(greedy_folder, "vllm") == {}
    assert SamplingParams(**_defaults(greedy_folder, "vllm")).temperature == 1.0
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "eos_token_id": 7}))
    args = EngineArgs(model=str(greedy_folder), max_model_len=128, generation_config=str(other))
    config = args.create_engine_config().model_config.generation_config
    assert sampling_defaults(config) == {"top_p": 0.5}
    assert config["eos_token_id"] != 7  # only the sampling keys come from the folder


def test_start_up_logs_the_defaults_once(greedy_folder):
    messages: list[str] = []  # the package logger does not propagate to caplog
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("inferengine.engine.arg_utils")
    logger.addHandler(handler)
    try:
        _defaults(greedy_folder)
    finally:
        logger.removeHandler(handler)
    lines = [m for m in messages if "default sampling" in m]
    assert len(lines) == 1
    assert "temperature=0.0 max_tokens=6" in lines[0] and "generation_config.json" in lines[0]


def test_bad_values_and_folders_fail_at_start_up(tiny_checkpoint, tmp_path):
    bad = _with_generation_config(tiny_checkpoint("llama3-tied"), tmp_path / "bad", top_p=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        _defaults(bad)
    assert _defaults(bad, "vllm") == {}
    with pytest.raises(ConfigError, match=r"no .*generation_config\.json"):
        _defaults(bad, str(tmp_path / "missing"))


def test_help_shows_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "--generation-config" in text and "generation_config.json" in text
