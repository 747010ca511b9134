"""What Multi-LoRA refuses, with the error saying why: bad adapter folders at the request, and
engine combinations not built with adapters at start-up; the adapter cap and hash key."""

from __future__ import annotations

import json
import shutil

import pytest

from inferengine import LLM, SamplingParams
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.lora.checker import AdapterChecker
from inferengine.lora.peft import LoRAError, check_adapter
from inferengine.lora.request import LoRARequest, admits_adapter
from tests.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def hf_config(base):
    return json.loads((base / "config.json").read_text())


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_adapter(base, tmp_path_factory.mktemp("good") / "a", 8, ["q_proj", "up_proj"], 16)


def test_a_good_adapter_reads_its_rank_scale_and_modules(good, hf_config):
    spec = check_adapter(good, hf_config, max_rank=8)
    assert spec.rank == 8 and spec.scale == 2.0
    assert len(spec.modules) == 2 * hf_config["num_hidden_layers"]
    assert "model.layers.0.self_attn.q_proj" in spec.modules
    checker = AdapterChecker(hf_config, max_rank=8)
    assert checker.check(LoRARequest("a", 1, str(good))) == spec
    with pytest.raises(LoRAError, match="already names the adapter"):
        checker.check(LoRARequest("b", 1, str(good) + "-copy"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(use_dora=True), "DoRA"),
        (dict(bias="lora_only"), "bias"),
        (dict(targets=["embed_tokens"]), "supported targets"),
    ],
)
def test_unsupported_adapters_are_refused(base, hf_config, tmp_path, kwargs, message):
    targets = kwargs.pop("targets", ["q_proj"])
    path = make_adapter(base, tmp_path / "a", 4, targets, 8, **kwargs)
    with pytest.raises(LoRAError, match=message):
        check_adapter(path, hf_config, max_rank=16)


def test_wrong_base_rank_and_missing_files_are_refused(good, hf_config, tiny_checkpoint, tmp_path):
    with pytest.raises(LoRAError, match="over --max-lora-rank 4"):
        check_adapter(good, hf_config, max_rank=4)
    other = make_adapter(tiny_checkpoint("llama2-bias"), tmp_path / "other", 4, ["q_proj"], 8)
    with pytest.raises(LoRAError, match="does not fit this base model"):
        check_adapter(other, hf_config, max_rank=16)
    with pytest.raises(LoRAError, match="does not exist"):
        check_adapter(tmp_path / "nowhere", hf_config, max_rank=16)
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match=r"no adapter_model\.safetensors"):
        check_adapter(partial, hf_config, max_rank=16)
    (partial / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        check_adapter(partial, hf_config, max_rank=16)


def test_requests_are_refused_before_they_run(base, good, tmp_path):
    params = SamplingParams(max_tokens=2)
    plain = LLM(str(base), max_model_len=64)
    with pytest.raises(InvalidRequestError, match="started without LoRA"):
        plain.generate("hi", params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(good)))
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="over --max-lora-rank 4"):
        llm.generate("hi", params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(good)))
    with pytest.raises(InvalidRequestError, match="2 LoRA requests for 1 prompts"):
        llm.generate("hi", params, use_tqdm=False, lora_request=[None, None])
    assert llm.generate("hi", params, use_tqdm=False)[0].outputs[0].token_ids  # still serves


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(enable_runtime_lora=True), "add --enable-lora"),
        (dict(enable_lora=True, max_lora_rank=300), "--max-lora-rank must be 1 to 256"),
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "--max-cpu-loras"),
        (dict(enable_lora=True, pipeline_parallel_size=2), "--pipeline-parallel-size"),
        (dict(enable_lora=True, model_impl="transformers"), "Transformers fallback"),
    ],
)
def test_engine_combinations_not_built_are_refused(base, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(base), max_model_len=64, **kwargs)


def test_the_adapter_cap_and_the_hash_key():
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", start=1))

    class Running:
        def __init__(self, lora):
            self.lora_request = lora

    running = [Running(a), Running(None), Running(b)]
    assert admits_adapter(None, running, 2) and admits_adapter(a, running, 2)
    assert not admits_adapter(c, running, 2) and admits_adapter(c, running, 3)
    tokens = list(range(64))
    plain = hash_prompt_blocks(tokens, 16)
    with_a = hash_prompt_blocks(tokens, 16, lora_int_id=1)
    assert all(x != y for x, y in zip(plain, with_a, strict=True))
    assert with_a == hash_prompt_blocks(tokens, 16, lora_int_id=1)
    assert with_a != hash_prompt_blocks(tokens, 16, lora_int_id=2)
    with pytest.raises(ValueError, match="at least 1"):
        LoRARequest("zero", 0, "/x")
