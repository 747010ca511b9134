"""Gemma 3 multimodal checkpoints (`Gemma3ForConditionalGeneration`) served as text only: the
config read from `text_config`, the decoder's weights found under either naming, the vision
tower skipped, greedy tokens equal to Transformers' multimodal model on text prompts (chunked
prefill and prefix hits too), and image content refused."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from inferengine import LLM
from inferengine.checkpoint.text_config import text_only_config
from inferengine.errors import InvalidRequestError
from inferengine.model import gemma3_mm
from inferengine.model.gemma import GemmaSpec
from inferengine.model.gemma3_mm import text_weight_name
from tests.conftest import BOS_ID, EOS_ID, TINY_ARCHS, VOCAB_SIZE, build_tokenizer, hf_greedy
from tests.entrypoints.test_llm_matches_transformers import (
    LENGTHS,
    MAX_TOKENS,
    MODES,
    _generate,
    _prompts,
    _token_ids,
)

# google/gemma-3-4b-it's config.json (before Transformers 5): the text settings it leaves out
# take Gemma3TextConfig's defaults.
HUB_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 256,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"},
}


def test_hub_config_reads_as_transformers_text_config():
    import transformers

    flat = text_only_config(copy.deepcopy(HUB_4B))
    theirs = transformers.Gemma3Config(**copy.deepcopy(HUB_4B))
    text = theirs.text_config
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "max_position_embeddings",
        "sliding_window",
        "rms_norm_eps",
        "query_pre_attn_scalar",
        "hidden_activation",
    ):
        assert flat[key] == getattr(text, key), key
    assert flat["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert flat["eos_token_id"] == [1, 106] and flat["torch_dtype"] == "bfloat16"
    assert flat["tie_word_embeddings"] is True and "vision_config" not in flat
    assert list(GemmaSpec.from_hf(flat, version=3).layer_types) == text.layer_types


def test_other_configs_are_left_alone():
    config = {"architectures": ["Gemma3ForCausalLM"], "text_config": {"hidden_size": 1}}
    assert text_only_config(config) is config


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.language_model.norm.weight", "model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("vision_tower.vision_model.post_layernorm.weight", None),
        ("model.vision_tower.encoder.layers.0.mlp.fc1.bias", None),
        ("multi_modal_projector.mm_input_projection_weight", None),
        ("model.multi_modal_projector.mm_soft_emb_norm.weight", None),
    ],
)
def test_weight_names_of_both_layouts(name, ours):
    assert text_weight_name(name) == ours


def _build(out_dir, layout: str):
    """A tiny random Gemma3ForConditionalGeneration (text model as the `gemma3` fixture's, head
    tied like the released checkpoints), saved with its weights named per `layout`: "as-saved"
    as Transformers writes them (`language_model.model.*`), "model-prefixed" as its modules name
    them (`model.language_model.*`, `model.vision_tower.*`)."""
    import transformers
    from safetensors.torch import load_file, save_file

    kwargs = copy.deepcopy(TINY_ARCHS["gemma3"][1])
    kwargs.pop("tie_word_embeddings")
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **kwargs,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=1,
        image_token_index=VOCAB_SIZE - 3,
        boi_token_index=VOCAB_SIZE - 2,
        eoi_token_index=VOCAB_SIZE - 1,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # as conftest.build_checkpoint: no near-ties, norms away from 1
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(3.0)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.eval().save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    file = out_dir / "model.safetensors"
    tensors = load_file(file)
    assert any(n.startswith("language_model.model.") for n in tensors)  # Transformers' own
    if layout == "model-prefixed":
        renamed = {}
        for name, t in tensors.items():
            for old, new in (
                ("language_model.model.", "model.language_model."),
                ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."),
            ):
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            renamed[name] = t
        save_file(renamed, file, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def tiny_gemma3_mm(tmp_path_factory):
    cache = {}

    def get(layout: str):
        if layout not in cache:
            cache[layout] = _build(tmp_path_factory.mktemp(f"gemma3-mm-{layout}"), layout)
        return cache[layout]

    return get


def _vision_count(path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum("vision_tower." in n or "multi_modal_projector." in n for n in f.keys())  # noqa: SIM118


@functools.cache
def _expected(path: str) -> list[list[int]]:
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return [hf_greedy(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS, strict=True)]


@pytest.mark.parametrize("layout", ["as-saved", "model-prefixed"])
def test_greedy_in_chunks_matches_transformers(tiny_gemma3_mm, layout, monkeypatch):
    infos: list[str] = []  # the package logger does not propagate to caplog
    monkeypatch.setattr(gemma3_mm.logger, "info", lambda m, *a: infos.append(m % a))
    path = tiny_gemma3_mm(layout)
    llm = LLM(str(path), max_model_len=512, dtype="float32", **MODES["chunked-prefill"])
    skipped = [m for m in infos if "vision tower and projector tensors" in m]
    assert skipped == [f"Gemma 3 served as text only: skipped {_vision_count(path)} vision tower "
                       "and projector tensors"]  # fmt: skip
    assert _token_ids(_generate(llm)) == _expected(str(tiny_gemma3_mm("as-saved")))


def test_prefix_cache_second_pass_hits_and_matches(tiny_gemma3_mm):
    path = tiny_gemma3_mm("as-saved")
    llm = LLM(str(path), max_model_len=512, dtype="float32", enable_prefix_caching=True)
    first, second = _generate(llm), _generate(llm)
    assert _token_ids(first) == _token_ids(second) == _expected(str(path))
    for length, output in zip(LENGTHS, second, strict=True):
        assert output.num_cached_tokens == ((length - 1) // 16) * 16


def test_image_content_is_refused():
    from inferengine.entrypoints.openai.protocol import ChatMessage
    from inferengine.entrypoints.openai.serving_chat import message_dicts

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message = ChatMessage(role="user", content=[{"type": "text", "text": "what is it?"}, image])
    with pytest.raises(InvalidRequestError) as e:
        message_dicts([message])
    assert "'image_url'" in e.value.message and "not supported" in e.value.message


def test_image_content_is_refused_by_llm_chat(tiny_gemma3_mm):
    llm = LLM(str(tiny_gemma3_mm("as-saved")), max_model_len=512, dtype="float32")
    image = {"type": "image", "url": "https://example.com/cat.png"}
    message = {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}
    with pytest.raises(InvalidRequestError, match="parts of type 'image' are not supported"):
        llm.chat([message], use_tqdm=False)
    text_only = {"role": "user", "content": [{"type": "text", "text": "hello"}]}
    assert llm.chat([text_only], use_tqdm=False)[0].outputs[0].token_ids
