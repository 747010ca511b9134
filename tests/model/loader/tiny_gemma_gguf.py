"""Test helpers: a tiny random Gemma 2 / Gemma 3 built with Transformers, with a SentencePiece-style
Gemma tokenizer, and a writer that turns it into a GGUF the way llama.cpp's converter does (norm
weights stored as 1 + w, Gemma's tensor names and metadata, no chat template)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
END_OF_TURN_ID = SPECIALS.index("<end_of_turn>")
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "Paris is the capital of France. What is the capital of France? The capital is Paris.",
    "In 2024 there were 365 days; numbers like 12345 are common.",
] * 30
# Dims are multiples of 32, so Q8_0 can hold every 2-D weight.
DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    sliding_window=16,
    query_pre_attn_scalar=32,  # llama.cpp scales by head_dim (hidden/heads for 27B)
)
# What llama.cpp writes (or hard-codes) for each: Gemma 3 one global layer in six with a local
# rope base of 10000 and linear scaling on the global layers (as the 4B and larger models);
# Gemma 2 every other layer global, soft caps in the file.
VARIANTS: dict[str, tuple[str, dict]] = {
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
    ),
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def build_tokenizer():
    """A Gemma tokenizer (BPE over "▁"-spelled text with byte fallback, as `GemmaTokenizer`)
    trained in-process: specials first, then the 256 byte tokens, then the learned pieces."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[])
    trainer_tok.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTES)}
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
        replace_extra_special_tokens=False,
    )
    return tok


def build_hf_model(out_dir: Path, variant: str, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, kwargs = VARIANTS[variant]
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_cls)(
        vocab_size=len(tokenizer),
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **DIMS,
        **copy.deepcopy(kwargs),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)  # larger weights, so logits differ visibly between tokens
            else:
                p.normal_(0.0, 0.3)  # (1 + w) norms: w is 0 at initialisation
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{_LAYER_NAMES[rest]}.{kind}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        stem
    ] + f".{kind}"


def _add_tokenizer(writer, hf_dir: Path) -> None:
    from gguf import TokenType

    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(
        [
            -1000.0 if t in SPECIALS else 0.0 if t in BYTES else -float(i)
            for i, t in enumerate(tokens)
        ]
    )
    types = {t: TokenType.CONTROL for t in SPECIALS} | {t: TokenType.BYTE for t in BYTES}
    writer.add_token_types([types.get(t, TokenType.NORMAL) for t in tokens])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


def write_gemma_gguf(
    hf_dir: Path,
    path: Path,
    qtype: str = "F32",
    *,
    arch: str | None = None,
    metadata: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `hf_dir`'s Gemma as llama.cpp would, 2-D weights in `qtype` (F32, F16 or Q8_0; norms
    stay F32 and hold 1 + w). `arch` overrides general.architecture, `metadata` sets (value) or
    drops (None) `{arch}.` keys, `extra_tensors` adds tensors."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    source_arch = "gemma2" if config["model_type"] == "gemma2" else "gemma3"
    arch = arch or source_arch
    weights = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{source_arch}")
    rope = config["rope_parameters"]
    full_rope = rope.get("full_attention", rope)
    keys = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "attention.sliding_window": config["sliding_window"],
        "rope.freq_base": full_rope["rope_theta"],
    }
    if full_rope.get("rope_type") == "linear":
        keys["rope.scaling.type"] = "linear"
        keys["rope.scaling.factor"] = full_rope["factor"]
    if source_arch == "gemma2":
        keys["attn_logit_softcapping"] = config["attn_logit_softcapping"]
        keys["final_logit_softcapping"] = config["final_logit_softcapping"]
    keys.update(metadata or {})
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    _add_tokenizer(writer, hf_dir)
    for hf_name, w in sorted(weights.items()):
        name = _gguf_name(hf_name)
        if name.endswith("norm.weight"):
            writer.add_tensor(name, (w + np.float32(1.0)).astype(np.float32))
        elif w.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, w.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qt), raw_dtype=qt)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
