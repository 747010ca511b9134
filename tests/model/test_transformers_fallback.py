"""The Transformers fallback: architectures without a native class (OLMo-2, GPT-NeoX) give
Transformers' greedy tokens through the engine, with chunked prefill, preemption and prefix hits;
Llama forced through it equals native; `--model-impl` picks and refuses as it says."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.checkpoint.architecture import choose_implementation, fallback_hf_config
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError, ModelLoadError
from inferengine.model.transformers_fallback import TransformersForCausalLM
from tests.conftest import FALLBACK_ARCHS, hf_greedy, hf_model

ARCHS = sorted(FALLBACK_ARCHS)
LENGTHS = [1, 9, 16, 31, 64, 100, 170, 300]
MAX_TOKENS = [32, 5, 17, 1, 24, 12, 9, 20]
# Prompts prefilled in chunks of at most 24 tokens; 24 pages cannot hold every request at once.
CHUNKED_AND_PREEMPTED = dict(
    max_model_len=330,
    max_num_batched_tokens=40,
    long_prefill_token_threshold=24,
    num_gpu_blocks_override=24,
)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in LENGTHS]


@functools.cache
def _expected(path: str) -> list[list[int]]:
    model = hf_model(path)
    return [hf_greedy(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS, strict=True)]


def _tokens(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def _model(llm: LLM):
    return llm.llm_engine.core.executor.worker.runner.model


@pytest.mark.parametrize("arch", ARCHS)
def test_fallback_matches_transformers_chunked_and_preempted(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    llm = LLM(path, **CHUNKED_AND_PREEMPTED)
    assert isinstance(_model(llm), TransformersForCausalLM)
    tokens, _ = _tokens(llm)
    assert tokens == _expected(path)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_fallback_prefix_hits_match_transformers(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    llm = LLM(path, max_model_len=512)
    first, _ = _tokens(llm)
    second, hits = _tokens(llm)
    assert first == second == _expected(path)
    assert hits == [((n - 1) // 16) * 16 for n in LENGTHS]


def test_llama_through_transformers_equals_native(tiny_checkpoint):
    path = str(tiny_checkpoint("llama3-tied"))
    native = LLM(path, model_impl="native", **CHUNKED_AND_PREEMPTED)
    forced = LLM(path, model_impl="transformers", **CHUNKED_AND_PREEMPTED)
    assert not isinstance(_model(native), TransformersForCausalLM)
    assert isinstance(_model(forced), TransformersForCausalLM)
    assert _tokens(forced)[0] == _tokens(native)[0] == _expected(path)


def test_dummy_weights_through_the_fallback(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("olmo2")), load_format="dummy", max_model_len=128)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def _with_architecture(src, dst, name: str):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [name]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unknown_architecture_says_neither_has_it(tiny_checkpoint, tmp_path):
    path = _with_architecture(tiny_checkpoint("olmo2"), tmp_path / "m", "FancyNewForCausalLM")
    with pytest.raises(ModelLoadError) as info:
        EngineArgs(model=str(path)).create_engine_config()
    message = str(info.value)
    assert "FancyNewForCausalLM" in message and "Transformers" in message
    assert "LlamaForCausalLM" in message and "register_model" in message


def test_native_on_an_unsupported_architecture_points_to_the_fallback(tiny_checkpoint):
    path = str(tiny_checkpoint("olmo2"))
    with pytest.raises(ModelLoadError, match=r"native.*Olmo2ForCausalLM.*auto or transformers"):
        EngineArgs(model=path, model_impl="native").create_engine_config()


def test_fallback_refuses_tensor_parallel(tiny_checkpoint):
    path = str(tiny_checkpoint("olmo2"))
    with pytest.raises(ConfigError, match="one device"):
        EngineArgs(model=path, tensor_parallel_size=2).create_engine_config()


def test_bad_model_impl_value(tiny_checkpoint):
    with pytest.raises(ConfigError, match="--model-impl must be one of auto, native"):
        EngineArgs(model=str(tiny_checkpoint("olmo2")), model_impl="vllm").create_engine_config()


def test_choice_and_reason():
    olmo = {"architectures": ["Olmo2ForCausalLM"]}
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert choose_implementation(llama).native
    assert not choose_implementation(olmo).native
    assert "no native implementation" in choose_implementation(olmo).describe()
    forced = choose_implementation(llama, "transformers")
    assert not forced.native and "--model-impl transformers" in forced.describe()
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        choose_implementation({"architectures": ["BertModel"]}, "transformers")


def test_fallback_config_gains_the_standard_keys():
    """GPT-2 spells its sizes n_layer, n_head, n_embd, n_positions."""
    gpt2 = {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64, "n_positions": 256}
    filled = fallback_hf_config({**gpt2, "vocab_size": 320})
    assert filled["num_hidden_layers"] == 3
    assert filled["num_attention_heads"] == 4
    assert filled["hidden_size"] == 64
    assert filled["max_position_embeddings"] == 256


def test_cli_flag():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "--model-impl", "transformers"]))
    assert args.model_impl == "transformers"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--model-impl", "other"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", [*ARCHS, "llama3-tied"])
def test_fallback_on_the_gpu_matches_transformers(tiny_checkpoint, arch):
    """float32 on the Triton backend (eagerly: the fallback captures no CUDA graphs), chunked
    and preempted, then a second pass that hits the prefix cache."""
    path = str(tiny_checkpoint(arch))
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        model_impl="transformers",
        **CHUNKED_AND_PREEMPTED,
    )
    try:
        assert isinstance(_model(llm), TransformersForCausalLM)
        assert not llm.llm_engine.core.executor.worker.runner.graphs.graphs
        first, _ = _tokens(llm)
        second, hits = _tokens(llm)
        assert first == second == _expected(path)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert sum(hits) > 0
    finally:
        llm.llm_engine.core.shutdown()


def test_fallback_checkpoint_missing_a_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_checkpoint("olmo2"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks or misshapes 1 tensors.*down_proj"):
        LLM(str(path))
