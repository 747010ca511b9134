"""Gemma 2/3 GGUF conversion: config, weights (llama.cpp's 1 + w norms undone) and tokenizer match
the original model and Transformers' own GGUF loader, the engine's greedy tokens match
Transformers', Gemma's chat template is supplied, and variants we cannot convert say so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from inferengine import LLM, SamplingParams
from inferengine.checkpoint.gguf import convert_gguf
from inferengine.errors import ModelLoadError
from tests.conftest import hf_greedy, hf_model
from tests.model.loader.tiny_gemma_gguf import (
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    build_hf_model,
    build_tokenizer,
    write_gemma_gguf,
)

CONFIG_KEYS = [
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "query_pre_attn_scalar",
    "sliding_window", "layer_types", "rope_parameters", "attn_logit_softcapping",
    "final_logit_softcapping", "hidden_activation",
]  # fmt: skip
PROMPT_LENGTHS = [5, 30, 70]  # windows of 16: the longer ones reach past the sliding window


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = build_hf_model(tmp_path_factory.mktemp(f"hf-{variant}"), variant)
        return built[variant]

    return get


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[BOS_ID, *torch.randint(7, vocab, (n,), generator=g).tolist()] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_config_weights_and_greedy_tokens_match_the_original(tiny_gemma, tmp_path, variant):
    hf_dir = tiny_gemma(variant)
    out = convert_gguf(write_gemma_gguf(hf_dir, tmp_path / "tiny.gguf"), tmp_path / "converted")
    original = json.loads((hf_dir / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert {k: config.get(k) for k in CONFIG_KEYS} == {k: original.get(k) for k in CONFIG_KEYS}
    assert config["model_type"] == original["model_type"]

    theirs, ours = (
        load_file(str(hf_dir / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert set(ours) == set(theirs)
    for name, w in theirs.items():
        # Norms went through float32 (1 + w) - 1; everything else is bit for bit.
        atol = 1e-7 if name.endswith("norm.weight") else 0.0
        np.testing.assert_allclose(ours[name], w, rtol=0, atol=atol, err_msg=name)
    assert np.abs(theirs["model.norm.weight"]).max() > 0.1  # the -1 shift is really tested

    reference = hf_model(hf_dir)
    prompts = _prompts(original["vocab_size"])
    with torch.no_grad():
        expected_logits = reference(torch.tensor([prompts[-1]])).logits[0]
        got = hf_model(out)(torch.tensor([prompts[-1]])).logits[0]
    torch.testing.assert_close(got, expected_logits, atol=1e-5, rtol=1e-5)
    # Our engine on the converted folder, prompts prefilled in chunks.
    llm = LLM(str(out), max_model_len=128, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(reference, p, 12) for p in prompts
    ]


def test_q8_0_weights_equal_transformers_own_gguf_loader(tiny_gemma, tmp_path):
    pytest.importorskip("accelerate", reason="Transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf_path = write_gemma_gguf(tiny_gemma("gemma3"), tmp_path / "tiny.gguf", "Q8_0")
    out = convert_gguf(gguf_path, tmp_path / "converted")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True), attn_implementation="eager",
    )  # fmt: skip
    ours = load_file(str(out / "model.safetensors"))
    for name, w in ours.items():
        np.testing.assert_array_equal(w, reference.state_dict()[name].numpy(), err_msg=name)


def test_tokenizer_chat_template_and_end_of_turn(tiny_gemma, tmp_path):
    from transformers import AutoTokenizer

    out = convert_gguf(
        write_gemma_gguf(tiny_gemma("gemma3"), tmp_path / "tiny.gguf"), tmp_path / "converted"
    )
    ours, original = AutoTokenizer.from_pretrained(out), build_tokenizer()
    for text in ["Hello world, the capital of France?", "  two  spaces\nand café 東京", "x"]:
        expected = [BOS_ID, *original(text, add_special_tokens=False).input_ids]
        assert ours(text).input_ids == expected, text
        assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
    render = dict(tokenize=False, add_generation_prompt=True)
    question = {"role": "user", "content": " What is the capital of France? "}
    assert ours.apply_chat_template([question], **render) == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    system = {"role": "system", "content": "Be brief."}
    answer = {"role": "assistant", "content": "Paris."}
    assert ours.apply_chat_template([system, question, answer, question], tokenize=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
    )
    ids = ours("<start_of_turn>user\n<end_of_turn>", add_special_tokens=False).input_ids
    assert ids[0] == END_OF_TURN_ID - 1 and ids[-1] == END_OF_TURN_ID  # each kept whole
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_ID, END_OF_TURN_ID]  # chat turns end there


def test_sliding_layers_listed_in_the_file(tiny_gemma, tmp_path):
    pattern = [True, False, True, True, False, True]
    gguf_path = write_gemma_gguf(
        tiny_gemma("gemma3"), tmp_path / "tiny.gguf",
        metadata={"attention.sliding_window_pattern": pattern},
    )  # fmt: skip
    config = json.loads(
        (convert_gguf(gguf_path, tmp_path / "converted") / "config.json").read_text()
    )
    assert config["layer_types"] == [
        "sliding_attention" if s else "full_attention" for s in pattern
    ]


BAD_VARIANTS = {
    # (writer arguments, words the message must hold)
    "gemma3n": (dict(arch="gemma3n"), ["'gemma3n'", "gemma3", "safetensors"]),
    "embedding-gemma": (dict(arch="gemma-embedding"), ["'gemma-embedding'", "gemma2"]),
    "extra-tensor": (
        dict(extra_tensors={"per_layer_token_embd.weight": np.zeros((4, 32), np.float32)}),
        ["per_layer_token_embd.weight", "safetensors"],
    ),
    "yarn-rope": (dict(metadata={"rope.scaling.type": "yarn"}), ["'yarn'", "safetensors"]),
    "no-window": (dict(metadata={"attention.sliding_window": None}), ["sliding_window"]),
    "pattern-length": (
        dict(metadata={"attention.sliding_window_pattern": [True, False]}),
        ["sliding_window_pattern", "6"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VARIANTS))
def test_variants_we_cannot_convert_are_refused(tiny_gemma, tmp_path, case):
    kwargs, words = BAD_VARIANTS[case]
    gguf_path = write_gemma_gguf(tiny_gemma("gemma3"), tmp_path / "tiny.gguf", **kwargs)
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(gguf_path, tmp_path / "converted")
    for word in words:
        assert word in e.value.message, (word, e.value.message)
    assert not (tmp_path / "converted").exists()
