"""Encoder-only BERT and XLM-RoBERTa (model/bert.py) with bidirectional attention on the paged
CPU backends: embeddings equal Sentence-Transformers' (CLS + Normalize, mean pooling) on tiny
random checkpoints in float32, in mixed batches whose prompts are never chunked."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from inferengine.entrypoints.llm import LLM
from inferengine.errors import ConfigError, InvalidRequestError
from tests.conftest import VOCAB_SIZE, build_tokenizer

PROMPTS = [[5 + (i * 7) % 90 for i in range(n)] for n in (1, 9, 40, 100)]


def encoder_folder(tmp_path, arch: str, mode: str, normalize: bool):
    import transformers

    config_cls = {"bert": "BertConfig", "xlm-roberta": "XLMRobertaConfig"}[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=130 if arch == "xlm-roberta" else 128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    folder = tmp_path / arch
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, f"pooling_mode_{mode}": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


@pytest.mark.parametrize(
    ("arch", "mode", "normalize"),
    [("bert", "cls_token", True), ("xlm-roberta", "mean_tokens", False)],
)
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, arch, mode, normalize):
    st = pytest.importorskip("sentence_transformers")
    folder = encoder_folder(tmp_path, arch, mode, normalize)
    ref = st.SentenceTransformer(str(folder), device="cpu")
    # The step budget is raised to cover max_model_len: every prompt runs whole, never chunked.
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=None, max_num_seqs=4)
    assert llm.llm_engine.config.scheduler_config.max_num_batched_tokens >= 128
    outs = llm.embed(PROMPTS, use_tqdm=False)
    again = llm.embed(PROMPTS[2], use_tqdm=False)[0]  # no prefix hit for an encoder
    for prompt, out in zip(PROMPTS, outs, strict=True):
        features = {
            "input_ids": torch.tensor([prompt]),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
        }
        with torch.no_grad():
            want = ref(features)["sentence_embedding"][0]
        got = torch.tensor(out.outputs.embedding)
        assert float(F.cosine_similarity(got, want, dim=0)) >= 0.99999
        assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(
        torch.tensor(again.outputs.embedding), torch.tensor(outs[2].outputs.embedding), atol=1e-6
    )


def test_encoder_limits(tmp_path):
    folder = encoder_folder(tmp_path, "bert", "cls_token", True)
    with pytest.raises(ConfigError, match="must cover"):
        LLM(str(folder), max_num_batched_tokens=64)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, max_model_len=64)
    assert len(llm.embed(list(range(5, 69)), use_tqdm=False)[0].outputs.embedding) == 64


def test_cross_encoder_scores_equal_transformers(tmp_path):
    """XLMRobertaForSequenceClassification with one label (bge-reranker-v2-m3's shape): the
    score is the sigmoid of the head's logit on the tokenizer's text pair."""
    import transformers

    config = transformers.XLMRobertaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=130,
        num_labels=1,
    )
    torch.manual_seed(1)
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    folder = tmp_path / "cross"
    model.save_pretrained(folder)
    tok = build_tokenizer()
    tok.save_pretrained(folder)
    query, docs = (
        "Where is Paris?",
        ["Paris is the capital of France.", "The quick brown fox", "hi"],
    )
    llm = LLM(str(folder), dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    with torch.no_grad():
        want = [
            float(torch.sigmoid(model(torch.tensor([tok(query, d)["input_ids"]])).logits[0, 0]))
            for d in docs
        ]
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="score"):
        llm.embed("hello", use_tqdm=False)
