"""Phi-3's LongRoPE: our per-position table equals Transformers' rotary below the switch point and,
past it, its long factors; a sequence decoded across the switch matches Transformers' cached
generation. (Logits and greedy tokens of the tiny Phi-3 are checked with every architecture.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from inferengine.model.layers.rotary import RotaryEmbedding
from inferengine.model.llama import _phi3_config
from tests.conftest import BOS_ID, EOS_ID, TINY_ARCHS, VOCAB_SIZE, build_checkpoint, hf_greedy
from tests.conftest import hf_model as load_hf_model
from tests.model.paged_runner import PagedLoop, load_tiny

SWITCH = 400  # original_max_position_embeddings of the tiny Phi-3
MAX_POSITION = 1024


def _hf_config():
    import transformers

    _, kwargs = TINY_ARCHS["phi3-longrope"]
    return transformers.Phi3Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITION,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **kwargs,
    )


def _hf_cos_sin(config, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' cos and sin (first half of the rotary dims) for one call at `positions`."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = Phi3RotaryEmbedding(config)
    position_ids = torch.tensor([list(positions)])
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), position_ids)
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize(
    ("positions", "factors"),
    [(range(0, SWITCH), "short"), (range(SWITCH, MAX_POSITION), "long")],
)
def test_longrope_table_matches_transformers(positions, factors):
    """Transformers picks the factors per call by its largest position: a call within the
    switch point uses the short ones, a call past it the long ones, for its every position."""
    config = _hf_config()
    ours = RotaryEmbedding(16, MAX_POSITION, json.loads(config.to_json_string()), rotary_dim=12)
    table = ours.cos_sin_cache[positions.start : positions.stop]
    cos, sin = _hf_cos_sin(config, positions)
    torch.testing.assert_close(table[:, :6], cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, 6:], sin, atol=1e-6, rtol=0)
    # The attention factor scales both halves.
    factor = math.sqrt(1 + math.log(MAX_POSITION / SWITCH) / math.log(SWITCH))
    assert float(ours.cos_sin_cache[0, 0]) == pytest.approx(factor, abs=1e-6)


def test_old_su_scaling_reads_as_longrope():
    """Early Phi-3 configs: `rope_scaling` {"type": "su"} beside a top-level switch point."""
    config = json.loads(_hf_config().to_json_string())
    scaling = dict(config.pop("rope_parameters"))
    old = {**config, "rope_scaling": {**scaling, "type": "su"}}
    del old["rope_scaling"]["rope_type"], old["rope_scaling"]["original_max_position_embeddings"]
    tables = [
        RotaryEmbedding(16, MAX_POSITION, _phi3_config(c), rotary_dim=12).cos_sin_cache
        for c in (old, {**config, "rope_parameters": scaling})
    ]
    torch.testing.assert_close(tables[0], tables[1], atol=0, rtol=0)


def test_decoding_across_the_switch_matches_transformers_cached_generation(tmp_path):
    """A prompt under the switch point decoded past it: Transformers' cache keeps the early
    keys short-rotated and rotates the new tokens with the long factors, as our table does."""
    path = build_checkpoint(
        "phi3-longrope", tmp_path / "phi3-64", original_max_position_embeddings=64
    )
    model, config = load_tiny(path)
    reference = load_hf_model(path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, VOCAB_SIZE, (n,), generator=g).tolist() for n in (50, 20)]
    loop = PagedLoop(model, config, num_seqs=len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    logits = loop.step(prompts)
    for _ in range(40):  # 50 + 40 tokens: past the switch point at 64
        next_tokens = [[int(lg[-1].argmax())] for lg in logits]
        for out, token in zip(outputs, next_tokens, strict=True):
            out.extend(token)
        logits = loop.step(next_tokens)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(reference, prompt, 40)
