"""Test helpers: a tiny random Llama built with Transformers, and a writer that turns it into a GGUF
the way llama.cpp's converter does (q/k rows permuted, tokenizer metadata), weights in any type."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "Paris is the capital of France. Zürich, café, naïve — unicode text 東京 🙂.",
    "In 2024 there were 365 days; 12345 and 67890 are numbers, so is 1000000.",
] * 30
# Dims are multiples of 256 so every 2-D weight can hold K-quant super-blocks.
MODEL_DIMS = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
VARIANTS: dict[str, dict] = {
    "untied": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "tied-llama3": dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
}
# K-quants: bytes per 256-value block, where its float16 scales sit, and a scale size that keeps
# weights near 0.1. `gguf` cannot quantize these, so tests fill the blocks with random bits.
KQUANT_BLOCKS = {
    "Q2_K": (84, (80, 82), 2e-3),
    "Q3_K": (110, (108,), 5e-4),
    "Q4_K": (144, (0, 2), 1e-4),
    "Q5_K": (176, (0, 2), 5e-5),
    "Q6_K": (210, (208,), 2.5e-5),
}


def build_tokenizer(digit_split: bool = False):
    """A byte-level BPE trained in-process (so it knows multi-digit merges); with `digit_split`
    digits are split one by one before BPE, as SmolLM's pre-tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if digit_split:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_hf_model(out_dir: Path, variant: str, seed: int = 0) -> Path:
    import torch
    import transformers

    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **MODEL_DIMS,
        **copy.deepcopy(VARIANTS[variant]),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # larger weights, so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _gguf_row_order(rows: int, n_head: int) -> np.ndarray:
    """The HF row each GGUF q/k row comes from: per head, the two rotary halves interleaved."""
    half = rows // n_head // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return np.concatenate([h * 2 * half + within for h in range(n_head)])


def llama3_divisors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.1 scaling: each frequency's divisor."""
    out = []
    orig, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _random_kquant(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    block_bytes, scale_offsets, scale = KQUANT_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        d = (rng.uniform(0.5, 1.5, size=blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * block_bytes)


def _gguf_name(hf_name: str) -> str:
    mapping = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{mapping[rest]}.{kind}"
    return f"{mapping[stem]}.{kind}"


def _add_tokenizer(writer, hf_dir: Path, pre: str, add_bos: bool) -> None:
    from gguf import TokenType

    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_llama_gguf(
    hf_dir: Path,
    path: Path,
    qtype: str = "F32",
    *,
    arch: str = "llama",
    pre: str = "gpt2",
    add_bos: bool = False,
    tensor_types: dict[str, str] | None = None,
    tokenizer_dir: Path | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write `hf_dir`'s model as llama.cpp would, 2-D weights in `qtype` (norms stay F32);
    `tensor_types` overrides the type of single GGUF tensors (random bytes if not quantizable),
    `tokenizer_dir` holds another tokenizer.json of the same vocabulary; `drop` leaves tensors out."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, tokenizer_dir or hf_dir, pre, add_bos)
    rng = np.random.default_rng(0)
    for hf_name, w in sorted(weights.items()):
        name = _gguf_name(hf_name)
        if name in drop:
            continue
        if ".attn_q." in name or ".attn_k." in name:
            w = w[_gguf_row_order(w.shape[0], heads if ".attn_q." in name else kv_heads)]
        ttype = (tensor_types or {}).get(name, qtype if w.ndim == 2 else "F32")
        _add_tensor(writer, name, w, ttype, rng)
    if config["rope_parameters"].get("rope_type") == "llama3":
        freqs = llama3_divisors(
            head_dim, config["rope_parameters"]["rope_theta"], config["rope_parameters"]
        )
        writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, name: str, w: np.ndarray, ttype: str, rng: np.random.Generator) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[ttype]
    if ttype == "F32":
        writer.add_tensor(name, w.astype(np.float32))
    elif ttype == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    elif ttype in KQUANT_BLOCKS:
        writer.add_tensor(name, _random_kquant(*w.shape, ttype, rng), raw_dtype=qtype)
    else:
        try:
            data = gguf.quants.quantize(w.astype(np.float32), qtype)
        except NotImplementedError:  # a type gguf cannot write: random bytes of the right size
            shape = gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
            data = rng.integers(0, 256, size=shape, dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=qtype)
