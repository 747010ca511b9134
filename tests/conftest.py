"""Shared fixtures: tiny random checkpoints of every supported architecture, built with
Transformers at test time, and Transformers' own greedy continuation as the reference."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

# name -> (transformers config class name, config kwargs)
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    # GQA, tied embeddings (like SmolLM / Llama-3.2-1B), llama3 rope scaling, odd layer count.
    "llama3-tied": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    # Llama 2 style: multi-head attention, untied head, biases on attention.
    "llama2-bias": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            attention_bias=True,
        ),
    ),
    # Mistral with a sliding window shorter than the longest prompts.
    "mistral-window": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=48,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen2: q/k/v biases.
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3: q/k RMSNorm, explicit head_dim unlike hidden/heads, 8:1 GQA.
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=False,
        ),
    ),
}

VOCAB_SIZE = 320
BOS_ID, EOS_ID = 0, 1


def build_tokenizer():
    """A small byte-level BPE tokenizer with a chat template, trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
        "Paris is the capital of France. Zürich, café, naïve — unicode text 東京 🙂.",
    ] * 40
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return fast


def build_checkpoint(name: str, out_dir: Path, seed: int = 0) -> Path:
    import transformers

    config_cls, kwargs = TINY_ARCHS[name]
    kwargs = copy.deepcopy(kwargs)
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Scale weights up a little so the random model's greedy choices are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.eval()
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> folder with config.json, model.safetensors and a tokenizer."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation, never stopping at EOS (a plain cached loop)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    tokens = []
    next_token = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        tokens.append(next_token)
        if len(tokens) == max_new_tokens:
            break
        out = model(torch.tensor([[next_token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        next_token = int(out.logits[0, -1].argmax())
    return tokens


def spy_core_requests(llm, monkeypatch) -> list:
    """The `EngineCoreRequest`s `llm` hands its engine core from now on."""
    requests: list = []
    core = llm.llm_engine.core
    add_request = core.add_request

    def spy(request) -> None:
        requests.append(request)
        add_request(request)

    monkeypatch.setattr(core, "add_request", spy)
    return requests
