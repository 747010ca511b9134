"""GGUF conversion: weights, config and tokenizer match the original model and Transformers' own
GGUF loader; bad files fail with a message that says what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from inferengine.checkpoint import gguf as gguf_loader
from inferengine.checkpoint.gguf import MARKER, convert_gguf
from inferengine.errors import ModelLoadError
from tests.model.loader.tiny_gguf import (
    BOS_ID,
    EOS_ID,
    LLAMA3_ROPE,
    build_tokenizer,
    llama3_divisors,
    write_llama_gguf,
)

LEGACY_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Worst error of one value as a fraction of the tensor's largest |value| (rounding, or clipping at
# the edge of the code range), plus slack for the float16 block scale.
ERROR_BOUND = {
    "F32": 0.0,
    "F16": 2**-11,
    "BF16": 2**-8,
    "Q8_0": 1 / 254,
    "Q5_0": 1 / 16,
    "Q5_1": 1 / 31,
    "Q4_0": 1 / 8,
    "Q4_1": 1 / 15,
}
TRANSFORMERS_CANNOT_READ = {"Q5_0", "Q5_1"}  # its GGUF dequantizer lacks these two
TEXTS = [
    "Hello world, how are you today?",
    "In 2024 there were 365 days; 12345 is a number.",
    "  leading spaces and café, naïve, 東京 🙂",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
]


def _logits(model_or_dir, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if isinstance(model_or_dir, Path):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, attn_implementation="eager")
    with torch.no_grad():
        return model(ids).logits[0]


def _transformers_gguf_model(gguf_path: Path):
    """Transformers' own reading of the GGUF, dequantized with its own (torch) code."""
    pytest.importorskip("accelerate", reason="Transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="eager",
    )


def _ids(seed: int = 0, n: int = 48) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", LEGACY_TYPES)
def test_quantizable_types_match_original_and_transformers(tiny_llama, tmp_path, qtype):
    hf_dir = tiny_llama("untied")
    gguf_path = write_llama_gguf(hf_dir, tmp_path / f"tiny-{qtype}.gguf", qtype)
    out = convert_gguf(gguf_path, tmp_path / "converted")

    original, ours = (
        load_file(str(hf_dir / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert set(ours) == set(original)
    for name, w in original.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == w.shape, name
        bound = ERROR_BOUND[qtype if w.ndim == 2 else "F32"] * 1.02 + 2**-10 * (qtype != "F32")
        err = np.abs(ours[name] - w).max()
        assert err <= bound * np.abs(w).max(), f"{name}: error {err} over {bound} of max |w|"

    ids = _ids()
    got = _logits(out, ids)
    if qtype == "F32":
        torch.testing.assert_close(got, _logits(hf_dir, ids), atol=1e-5, rtol=1e-5)
    if qtype not in TRANSFORMERS_CANNOT_READ:
        expected = _logits(_transformers_gguf_model(gguf_path), ids)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_match_transformers(tiny_llama, tmp_path, qtype):
    """Random K-quant blocks (gguf cannot quantize to these): our dequantization (gguf's numpy) and
    un-permutation must equal Transformers' independent torch dequantizer, value for value."""
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / f"tiny-{qtype}.gguf", qtype)
    out = convert_gguf(gguf_path, tmp_path / "converted")
    reference = _transformers_gguf_model(gguf_path)
    ours = load_file(str(out / "model.safetensors"))
    for name, w in reference.state_dict().items():
        np.testing.assert_allclose(ours[name], w.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
    ids = _ids(1)
    torch.testing.assert_close(_logits(out, ids), _logits(reference, ids), atol=1e-5, rtol=1e-5)


def test_config_tied_embeddings_and_llama3_rope(tiny_llama, tmp_path):
    hf_dir = tiny_llama("tied-llama3")
    out = convert_gguf(write_llama_gguf(hf_dir, tmp_path / "tiny.gguf"), tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "vocab_size": 400,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    assert {k: config.get(k) for k in expected} == expected
    assert config["rope_scaling"] == LLAMA3_ROPE  # recovered from llama.cpp's rope_freqs tensor
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}

    ids = _ids(2, n=64)
    expected_logits = _logits(hf_dir, ids)
    torch.testing.assert_close(_logits(out, ids), expected_logits, atol=1e-5, rtol=1e-5)
    # The check above can see a wrong rope: without the scaling the logits move.
    del config["rope_scaling"]
    (out / "config.json").write_text(json.dumps(config))
    assert not torch.allclose(_logits(out, ids), expected_logits, atol=1e-3)


@pytest.mark.parametrize(
    ("rope", "head_dim"),
    [
        ({**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192}, 64),  # 3.2
        ({**LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192}, 128),  # 3.1
        ({**LLAMA3_ROPE, "high_freq_factor": 2.0, "original_max_position_embeddings": 512}, 128),
    ],
)
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(rope, head_dim):
    divisors = llama3_divisors(head_dim, 500000.0, rope).astype(np.float64)
    assert gguf_loader._llama3_scaling(Path("x.gguf"), divisors, 500000.0, head_dim) == rope
    assert gguf_loader._llama3_scaling(Path("x.gguf"), divisors * 0 + 1, 500000.0, head_dim) is None


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_tokenizer_matches_original(tiny_llama, tmp_path, pre):
    """`smollm` splits digits before BPE (llama.cpp's rule for that pre-tokenizer); the vocabulary
    knows multi-digit merges, so a missed split would change the ids."""
    from transformers import AutoTokenizer

    original = build_tokenizer(digit_split=pre == "smollm")
    original.save_pretrained(tmp_path / "tok")
    gguf_path = write_llama_gguf(
        tiny_llama("untied"), tmp_path / "tiny.gguf", pre=pre, tokenizer_dir=tmp_path / "tok"
    )
    ours = AutoTokenizer.from_pretrained(convert_gguf(gguf_path, tmp_path / "converted"))
    for text in TEXTS:
        assert ours(text).input_ids == original(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    if pre == "gpt2":  # Transformers' own GGUF tokenizer agrees where it knows the pre-tokenizer
        theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
        assert [ours(t).input_ids for t in TEXTS] == [theirs(t).input_ids for t in TEXTS]
    else:
        assert build_tokenizer()("12345").input_ids != original("12345").input_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    render = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, **render) == original.apply_chat_template(
        messages, **render
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


def test_tokenizer_adds_bos_when_the_file_says_so(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf", add_bos=True)
    ours = AutoTokenizer.from_pretrained(convert_gguf(gguf_path, tmp_path / "converted"))
    assert ours("Hello world").input_ids == [BOS_ID, *build_tokenizer()("Hello world").input_ids]


def test_unsupported_architecture(tiny_llama, tmp_path):
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf", arch="falcon")
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(gguf_path, tmp_path / "converted")
    assert "'falcon'" in e.value.message and "llama" in e.value.message
    assert "safetensors" in e.value.message  # what to do instead
    assert not (tmp_path / "converted").exists()


def test_unsupported_tensor_type(tiny_llama, tmp_path):
    gguf_path = write_llama_gguf(
        tiny_llama("untied"),
        tmp_path / "tiny.gguf",
        tensor_types={"blk.1.ffn_down.weight": "IQ2_XXS"},
    )
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(gguf_path, tmp_path / "converted")
    message = e.value.message
    assert "blk.1.ffn_down.weight" in message and "IQ2_XXS" in message
    assert "Q4_0" in message and "Q6_K" in message  # the supported list
    assert "Re-quantize" in message and "Q8_0" in message  # what to do
    assert list(tmp_path.iterdir()) == [gguf_path]


@pytest.mark.parametrize(
    "keep", ["2 bytes", "header", "metadata", "half the tensors", "all but 1 byte"]
)
def test_truncated_file(tiny_llama, tmp_path, keep):
    data = write_llama_gguf(tiny_llama("untied"), tmp_path / "full.gguf").read_bytes()
    cut = {
        "2 bytes": 2,
        "header": 20,
        "metadata": 2000,
        "half the tensors": len(data) // 2,
        "all but 1 byte": len(data) - 1,
    }[keep]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(truncated, tmp_path / "converted")
    assert "corrupt" in e.value.message and "re-download" in e.value.message
    assert "truncated" in e.value.message or cut < 4
    assert not (tmp_path / "converted").exists()


def test_not_a_gguf_file_and_missing_file(tmp_path):
    page = tmp_path / "model.gguf"
    page.write_text("<html>404 Not Found</html>")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file.*re-download"):
        convert_gguf(page, tmp_path / "converted")
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "converted")


def test_crash_leaves_no_folder(tiny_llama, tmp_path, monkeypatch):
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "_write_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, tmp_path / "converted")
    assert list(tmp_path.iterdir()) == [gguf_path]  # no half folder, no temp folder


def test_reconversion_replaces_but_foreign_folder_is_refused(tiny_llama, tmp_path):
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf")
    out = tmp_path / "converted"
    convert_gguf(gguf_path, out)
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf(gguf_path, out)
    assert (out / MARKER).exists() and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "tiny.gguf"]

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ModelLoadError, match="not an InferEngine GGUF conversion"):
        convert_gguf(gguf_path, foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_engine_resolves_a_gguf_path(tiny_llama, tmp_path, monkeypatch):
    from inferengine.checkpoint.resolve import resolve_model

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_llama_gguf(tiny_llama("untied"), tmp_path / "tiny.gguf", "Q8_0")
    resolved = resolve_model(str(gguf_path))
    assert resolved.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert resolved.path.is_relative_to(tmp_path / "cache")
    assert resolve_model(str(gguf_path)).path == resolved.path  # cached, not converted again
    shutil.rmtree(tmp_path / "cache")
