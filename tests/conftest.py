"""Shared fixtures: tiny random checkpoints of every supported architecture, built with
Transformers at test time, and Transformers' own greedy continuation as the reference."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import sys
from pathlib import Path


def _pin_xdist_worker_to_one_gpu() -> None:
    """On a host of several GPUs, `GPU_TESTS_DEVICES=0,1` (benchmarks/gpu_tests.sh) spreads
    pytest-xdist's workers over them: worker gwN sees only device N mod their count. Set before
    anything touches CUDA."""
    devices, worker = os.environ.get("GPU_TESTS_DEVICES"), os.environ.get("PYTEST_XDIST_WORKER")
    if devices and worker:
        ids = devices.split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker.removeprefix("gw")) % len(ids)]


_pin_xdist_worker_to_one_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str | None = None, register: bool = False):
    """A script of the repository (`benchmarks/x.py`, `docs/hooks/y.py`) loaded as a module;
    `register` puts it in sys.modules under `name` (dataclasses of the script need that)."""
    path = REPO_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def logged_messages(level: int = logging.NOTSET, logger: str = "inferengine"):
    """The messages `logger` emits at `level` or above while the block runs (the package logger
    does not propagate to pytest's caplog)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(logger).removeHandler(handler)


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
    # Phi-3: fused qkv and gate_up in the checkpoint, LongRoPE whose switch point (400) lies past
    # every test prompt, partial rotary (12 of 16 dims), a sliding window.
    "phi3-longrope": (
        "Phi3Config",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=400,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 1.9, 2.2],
                "long_factor": [1.0, 1.5, 3.0, 6.0, 9.0, 12.0],
            },
            sliding_window=64,
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
    ),
    # Mixtral: 4 experts, top-2 (a softmax over the chosen logits), every layer sparse.
    "mixtral": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-MoE: 8 experts, top-4 renormalised, q/k norm; layer 1 dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    # Gemma 2: attention and final logit soft-capping (caps low enough to bite), every other
    # layer a sliding window, query_pre_attn_scalar unlike head_dim, tied head.
    "gemma2": (
        "Gemma2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=40,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
    ),
    # Gemma 3: q/k norms, local and global layers with their own rope (linear scaling on the
    # global ones), head dim 64 over hidden 64, MQA, untied head.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=48,
            sliding_window=40,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=False,
        ),
    ),
}

# Architectures without a native class, served through the Transformers fallback.
FALLBACK_ARCHS: dict[str, tuple[str, dict]] = {
    # OLMo-2: q/k RMSNorm over all heads, norms after attention and MLP, GQA.
    "olmo2": (
        "Olmo2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
    ),
    # GPT-NeoX: fused interleaved qkv, parallel residual, LayerNorm with biases, GELU, a quarter
    # of each head rotated.
    "gpt-neox": (
        "GPTNeoXConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
    ),
}

VOCAB_SIZE = 320
BOS_ID, EOS_ID = 0, 1


def build_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """A small byte-level BPE tokenizer with a chat template, trained in-process; special tokens
    `<s>`, `</s>` and then `extra_special_tokens` (ids 2, 3, ...)."""
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
        special_tokens=["<s>", "</s>", *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return fast


def build_checkpoint(name: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    config_cls, kwargs = {**TINY_ARCHS, **FALLBACK_ARCHS}[name]
    kwargs = {**copy.deepcopy(kwargs), **overrides}  # overrides: a variant of `name`
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
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(3.0)
            elif config.model_type.startswith("gemma") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # Gemma norms scale by (1 + w), w initialised to 0
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
