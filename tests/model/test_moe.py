"""Mixture-of-experts models beyond the shared Transformers comparison: the fused checkpoint
layout, a missing expert, and the per-layer expert counts (padding left out)."""

from __future__ import annotations

import shutil

import pytest
import torch

from inferengine.errors import ModelLoadError
from inferengine.model.layers.moe import SparseMoeBlock
from tests.conftest import hf_model
from tests.model.paged_runner import PagedLoop, load_tiny


def _copy_without_weights(source, target) -> None:
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, target / f.name)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_fused_expert_tensors_load(tiny_checkpoint, tmp_path, arch):
    """Transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) loads like the per-expert tensors its save_pretrained writes."""
    from safetensors.torch import save_file

    source = tiny_checkpoint(arch)
    reference = hf_model(source)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    _copy_without_weights(source, tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompt = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    model, config = load_tiny(tmp_path)
    logits = PagedLoop(model, config, num_seqs=1).step([prompt])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_a_missing_expert_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("mixtral")
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    _copy_without_weights(source, tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"expert weights of layer 1 \(expert 2 up\)"):
        load_tiny(tmp_path)


def test_expert_counts_per_sparse_layer(tiny_checkpoint):
    """Each token counts once for each of its top-k experts, in sparse layers only (layer 1
    of the tiny Qwen3-MoE is dense); a reset starts again from zero."""
    model, config = load_tiny(tiny_checkpoint("qwen3-moe"))
    loop = PagedLoop(model, config, num_seqs=2)
    loop.step([list(range(2, 30)), list(range(40, 45))])
    loop.step([[7], [8]])
    counts = model.expert_token_counts()
    assert sorted(counts) == [0, 2]
    assert all(len(row) == 8 and sum(row) == (33 + 2) * 4 for row in counts.values())
    model.reset_expert_token_counts()
    assert all(sum(row) == 0 for row in model.expert_token_counts().values())


def test_padding_tokens_are_not_counted():
    torch.manual_seed(0)
    block = SparseMoeBlock(16, num_experts=4, top_k=2, intermediate_size=8, renormalize=True)
    for p in block.parameters():
        p.data.normal_()
    x = torch.randn(5, 16)
    block(x, torch.tensor([3, -1, 17, -1, 4]))  # tokens 1 and 3 pad a captured shape
    assert int(block.expert_tokens[:4].sum()) == 3 * 2
    block(x)  # no slot mapping: every token counts
    assert int(block.expert_tokens[:4].sum()) == 8 * 2
