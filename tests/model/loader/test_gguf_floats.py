"""Lean GGUF folders (the model cache's): float copies only of what the CPU's quantized path
reads; a load on that path writes none and gives the full folder's logits; a load that reads
floats (--gguf-dequantize here, as CUDA would) writes the rest once, after which the folder is
the full conversion's checkpoint, for us and for Transformers."""

from __future__ import annotations

import torch
from safetensors.numpy import load_file

from inferengine.checkpoint.gguf import convert_gguf
from inferengine.checkpoint.gguf_source import block_only
from inferengine.model.loader.gguf_floats import (
    DENSE_FILE,
    FLOATS_FILE,
    INDEX_FILE,
    ensure_float_weights,
)
from tests.model.loader.test_gguf_quantized import (
    _load,
    _logits,
    _quantized_modules,
    _tiny_gguf,
    needs_kernels,
)

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _floats(folder) -> dict:
    """Every float tensor in the folder's safetensors files, by name."""
    out: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        assert not set(tensors) & set(out)  # no tensor twice
        out |= tensors
    return out


def test_block_only_takes_whole_layers_of_one_block_kind():
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "output_norm.weight": "F32"}
    types |= {f"blk.0.{role}.weight": "Q4_1" for role in LINEARS}
    types |= {f"blk.1.{role}.weight": "Q4_K" for role in LINEARS}
    types["blk.1.attn_v.weight"] = "Q8_0"  # q/k/v of two kinds: one dense layer
    types["blk.1.ffn_up.weight"] = "Q6_K"  # not ours: gate/up dense
    types["blk.1.attn_norm.weight"] = "F32"
    expected = {"token_embd.weight", "output.weight"} | {f"blk.0.{role}.weight" for role in LINEARS}
    expected |= {"blk.1.attn_output.weight", "blk.1.ffn_down.weight"}
    assert block_only(types) == expected
    assert "token_embd.weight" not in block_only(types | {"token_embd.weight": "Q6_K"})


@needs_kernels
def test_a_lean_folder_serves_the_quantized_path_without_float_copies(tiny_llama, tmp_path):
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    full = convert_gguf(gguf_path, tmp_path / "full")
    lean = convert_gguf(gguf_path, tmp_path / "lean", lean=True)
    # Q4_1 everywhere but layer 1's Q8_0 down projection (ours) and Q6_K output projection
    # (not ours), and a Q4_0 head: all floats left out but those of the norms and the Q6_K
    # weight.
    left_out = set(_floats(full)) - set(_floats(lean))
    assert left_out == {
        f"model.layers.{i}.{part}_proj.weight"
        for i in (0, 1)
        for part in ("self_attn.q", "self_attn.k", "self_attn.v", "mlp.gate", "mlp.up", "mlp.down")
    } | {"model.layers.0.self_attn.o_proj.weight", "lm_head.weight", "model.embed_tokens.weight"}
    saved = (full / "model.safetensors").stat().st_size - (lean / FLOATS_FILE).stat().st_size
    assert saved >= sum(value.nbytes for name, value in _floats(full).items() if name in left_out)

    model, config = _load(lean)
    assert len(_quantized_modules(model)) == 2 * 4 - 1 + 1
    assert not (lean / DENSE_FILE).exists() and not (lean / INDEX_FILE).exists()
    reference, _ = _load(full)
    prompts = [[1, 5, 9, 33, 70], [2, 100, 200]]
    for got, want in zip(
        _logits(model, config, prompts), _logits(reference, config, prompts), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_load_that_reads_floats_writes_them_once_and_completes_the_folder(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    full = convert_gguf(gguf_path, tmp_path / "full")
    lean = convert_gguf(gguf_path, tmp_path / "lean", lean=True)
    model, config = _load(lean, dequantize=True)
    assert _quantized_modules(model) == []
    expected = _floats(full)
    got = _floats(lean)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert (got[name] == value).all(), name
    reference, _ = _load(full, dequantize=True)
    prompts = [[1, 5, 9, 33, 70], [2, 100, 200]]
    for a, b in zip(
        _logits(model, config, prompts), _logits(reference, config, prompts), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    written = (lean / DENSE_FILE).stat().st_mtime_ns
    ensure_float_weights(lean)  # complete: nothing to write
    _load(lean, dequantize=True)
    assert (lean / DENSE_FILE).stat().st_mtime_ns == written

    theirs = AutoModelForCausalLM.from_pretrained(lean).state_dict()  # through the index
    assert torch.equal(
        theirs["model.layers.0.mlp.up_proj.weight"],
        torch.from_numpy(expected["model.layers.0.mlp.up_proj.weight"]),
    )


def test_the_model_cache_converts_lean(tiny_llama, tmp_path, monkeypatch):
    from inferengine.checkpoint.resolve import resolve_model

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = resolve_model(str(_tiny_gguf(tiny_llama, tmp_path, "untied"))).path
    names = set(_floats(folder))
    assert "model.layers.0.mlp.up_proj.weight" not in names
    assert "model.embed_tokens.weight" not in names and "model.norm.weight" in names


def test_a_gemma_folder_completed_on_demand_equals_its_full_conversion(tmp_path):
    """Gemma's floats carry its own layout (norms stored as 1 + w): written on demand, they are
    the full conversion's, bit for bit."""
    from tests.model.loader.tiny_gemma_gguf import build_hf_model, write_gemma_gguf

    gguf_path = write_gemma_gguf(
        build_hf_model(tmp_path / "hf", "gemma3"), tmp_path / "g.gguf", "Q8_0"
    )
    full = convert_gguf(gguf_path, tmp_path / "full")
    lean = convert_gguf(gguf_path, tmp_path / "lean", lean=True)
    assert len(_floats(lean)) < len(_floats(full))
    ensure_float_weights(lean)
    expected, got = _floats(full), _floats(lean)
    assert set(got) == set(expected)
    assert all((got[name] == value).all() for name, value in expected.items())
