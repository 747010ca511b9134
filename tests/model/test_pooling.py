"""Embeddings through the engine equal Transformers' (and Sentence-Transformers') pooling of the
same tiny random decoders: last-token and mean pooling, normalization, Matryoshka cuts, mixed
batch lengths, chunked prefill and a prefix-cache hit, in float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from inferengine.entrypoints.llm import LLM
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.pooling_params import PoolingParams
from inferengine.sampling_params import SamplingParams

PROMPTS = [[5 + i for i in range(n)] for n in (1, 7, 33, 70)]  # mixed lengths, one over 64


def _hf_hidden(path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def _st_folder(src, dst, mode: str, normalize: bool):
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (dst / "2_Normalize").mkdir()
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, f"pooling_mode_{mode}": True}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return dst


def _cos(a, b) -> float:
    return float(F.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_last_token_embeddings_equal_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    # A 32-token step budget splits the 70-token prompt into three chunks.
    llm = LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=32)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = F.normalize(_hf_hidden(path, prompt)[-1], dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape
        assert _cos(got, want) >= 0.99999
        assert torch.allclose(got, want, atol=1e-4)
    # Matryoshka: the leading 16 components, normalized after the cut; raw without normalize.
    cut = llm.embed(PROMPTS[2], PoolingParams(dimensions=16), use_tqdm=False)[0]
    want = F.normalize(_hf_hidden(path, PROMPTS[2])[-1][:16], dim=0)
    assert _cos(cut.outputs.embedding, want) >= 0.99999 and len(cut.outputs.embedding) == 16
    raw = llm.embed(PROMPTS[1], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert torch.allclose(
        torch.tensor(raw.outputs.embedding), _hf_hidden(path, PROMPTS[1])[-1], atol=1e-4
    )


def test_prefix_hit_and_mean_pooling_match_sentence_transformers(tiny_checkpoint, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    src = tiny_checkpoint("qwen3")
    long = [7 + (i % 50) for i in range(48)]
    for mode, normalize in (("lasttoken", True), ("mean_tokens", False)):
        folder = _st_folder(src, tmp_path / mode, mode, normalize)
        ref = st.SentenceTransformer(str(folder), device="cpu")
        llm = LLM(str(folder), dtype="float32", block_size=16)  # runner auto: modules.json
        first = llm.embed(long, use_tqdm=False)[0]
        stats0 = llm.llm_engine.core.scheduler.make_stats()
        again = llm.embed([long, long[:40]], use_tqdm=False)
        stats1 = llm.llm_engine.core.scheduler.make_stats()
        hits = stats1.prefix_cache_hits - stats0.prefix_cache_hits
        # Last-token pooling reuses the cached prefix; mean pooling reads every position.
        assert (hits > 0) == (mode == "lasttoken")
        for prompt, out in ((long, first), (long, again[0]), (long[:40], again[1])):
            features = {
                "input_ids": torch.tensor([prompt]),
                "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
            }
            with torch.no_grad():
                want = ref(features)["sentence_embedding"][0]
            assert _cos(out.outputs.embedding, want) >= 0.99999
            assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-4)


def test_bad_pooling_requests_are_refused(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    generator = LLM(str(path), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="pooling model"):
        generator.embed("hello", use_tqdm=False)
    embedder = LLM(str(path), runner="pooling", dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="embedding"):
        embedder.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        embedder.embed([5, 6], PoolingParams(dimensions=10_000), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        embedder.embed(list(range(5, 80)), use_tqdm=False)
    short = embedder.embed(list(range(5, 80)), use_tqdm=False, truncate_prompt_tokens=-1)[0]
    assert short.prompt_token_ids == list(range(16, 80))
    with pytest.raises(ConfigError, match="--convert must be one of"):
        LLM(str(path), runner="pooling", convert="reward")


@pytest.mark.parametrize(
    ("arch", "config_cls"), [("qwen2", "Qwen2Config"), ("llama3-tied", "LlamaConfig")]
)
def test_headless_decoder_checkpoints(tmp_path, arch, config_cls):
    """A checkpoint saved without an LM head (e5-mistral's `MistralModel`, `Qwen2Model`) runs as
    an embedder (runner auto), equal to Transformers' base model; generating from it is refused."""
    import transformers

    from tests.conftest import TINY_ARCHS, VOCAB_SIZE, build_tokenizer

    kwargs = {**TINY_ARCHS[arch][1], "tie_word_embeddings": False}
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE, max_position_embeddings=256, **kwargs
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(tmp_path / arch)
    build_tokenizer().save_pretrained(tmp_path / arch)
    llm = LLM(str(tmp_path / arch), dtype="float32")
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False), strict=True):
        with torch.no_grad():
            want = F.normalize(model(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0)
        assert _cos(out.outputs.embedding, want) >= 0.99999
    with pytest.raises(ConfigError, match="no LM head"):
        LLM(str(tmp_path / arch), runner="generate")
