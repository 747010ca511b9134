"""Gemma config reading: older hub-style config.json files (no `layer_types`, a local rope base
and rope scaling beside the global rope) read as Transformers 5 reads them; what we cannot
serve is refused."""

from __future__ import annotations

import pytest

from inferengine.errors import ModelLoadError
from inferengine.model.gemma import FULL, SLIDING, GemmaSpec
from inferengine.model.layers.rotary import rope_parameters

# google/gemma-3-4b-it's text config as its config.json spelled it before Transformers 5.
LEGACY_GEMMA3 = dict(
    num_hidden_layers=8,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling={"factor": 8.0, "rope_type": "linear"},
    sliding_window_pattern=4,
    query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh",
)


def _transformers_view(kwargs: dict):
    import transformers

    return transformers.Gemma3TextConfig(**kwargs)


def test_legacy_gemma3_config_reads_like_transformers():
    spec = GemmaSpec.from_hf(dict(LEGACY_GEMMA3), version=3)
    theirs = _transformers_view(dict(LEGACY_GEMMA3))
    assert list(spec.layer_types) == theirs.layer_types
    assert spec.layer_types.count(FULL) == 2
    for kind in (FULL, SLIDING):
        ours = rope_parameters(spec.rope_configs[kind])
        expected = theirs.rope_parameters[kind]
        assert ours["rope_type"] == expected["rope_type"], kind
        assert ours["rope_theta"] == expected["rope_theta"], kind
        assert ours.get("factor") == expected.get("factor"), kind


def test_gemma2_defaults_every_other_layer_and_keeps_its_caps():
    config = dict(num_hidden_layers=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    spec = GemmaSpec.from_hf(config, version=2)
    assert spec.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (spec.attn_soft_cap, spec.final_soft_cap) == (50.0, 30.0)
    # Transformers' Gemma 3 attention takes no soft cap whatever its config says.
    assert GemmaSpec.from_hf(config, version=3).attn_soft_cap is None


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (dict(hidden_activation="silu"), ["'silu'", "gelu_pytorch_tanh"]),
        (dict(use_bidirectional_attention=True), ["EmbeddingGemma"]),
        (dict(layer_types=["sliding_attention"] * 3), ["4 entries"]),
    ],
)
def test_configs_we_cannot_serve_are_refused(extra, words):
    with pytest.raises(ModelLoadError) as e:
        GemmaSpec.from_hf(dict(num_hidden_layers=4, **extra), version=3)
    for word in words:
        assert word in e.value.message
