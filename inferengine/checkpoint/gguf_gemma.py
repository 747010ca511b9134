"""What converting a Gemma 2 / Gemma 3 GGUF (as llama.cpp's converter writes one) needs beyond a
Llama one: its metadata turned into a Transformers config, its tensor names, its norm convention
and Gemma's chat template.

llama.cpp stores every Gemma RMSNorm weight with 1 already added (its graph multiplies by w,
Transformers by 1 + w), so the converter subtracts 1 again. Its q/k rows are in Transformers'
order (Gemma uses NeoX rotation there), so unlike Llama nothing is un-permuted. What llama.cpp
does not write it hard-codes, and so do we: Gemma 3's local rope base 10000 and one global layer
in six, Gemma 2's every other layer, and the query scale (head_dim, or hidden/heads for 27B).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from inferengine.errors import ModelLoadError

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# GGUF tensor role in a block -> Transformers module of the decoder layer.
GEMMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama.cpp's sliding-window layout when the file does not list it: every n-th layer is global.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp scales queries by (hidden/heads)^-0.5 instead of head_dim^-0.5 for the 27B models,
# which it recognises by their layer count.
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}
END_OF_TURN = "<end_of_turn>"

# Gemma 3's chat template without its image items (Gemma 2's, plus a system turn folded into the
# first user turn): for GGUF files that carry no template.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


def gemma_layer_tensors(arch: str) -> dict[str, str]:
    return {**GEMMA_LAYER_TENSORS, **(GEMMA3_QK_NORMS if arch == "gemma3" else {})}


def _f32(value: Any) -> float:
    return float(str(np.float32(value)))


def attention_shape(meta: Any) -> tuple[int, int, int, int]:
    """(hidden size, query heads, KV heads, head dim) from a GGUF's metadata (`meta`: the
    loader's `_Metadata`); one KV head count for every layer."""
    hidden = int(meta.arch_key("embedding_length"))
    heads = int(meta.arch_key("attention.head_count"))
    kv_heads = meta.arch_key("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int | np.integer):
        raise ModelLoadError(f"{meta.path}: per-layer KV head counts are not supported.")
    head_dim = int(meta.arch_key("attention.key_length", hidden // heads))
    return hidden, heads, int(kv_heads), head_dim


def gemma_config(meta: Any, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The Transformers config.json of a Gemma 2/3 GGUF (`meta`: the loader's `_Metadata`)."""
    arch = meta.arch
    hidden, heads, kv_heads, head_dim = attention_shape(meta)
    if int(meta.arch_key("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{meta.path}: key and value head sizes differ; not a Gemma 2/3 file.")
    num_layers = int(meta.arch_key("block_count"))
    big = num_layers == _LAYERS_OF_27B[arch]
    config: dict[str, Any] = {
        "architectures": ["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"],
        "model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_key("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": _f32(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.arch_key("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "sliding_window": int(meta.arch_key("attention.sliding_window")),
        "layer_types": _layer_types(meta, num_layers),
        "attn_logit_softcapping": _cap(meta, "attn_logit_softcapping")
        if arch == "gemma2"
        else None,
        "final_logit_softcapping": _cap(meta, "final_logit_softcapping"),
        "rope_parameters": _rope(meta),
        "torch_dtype": "float32",
    }
    return config


def _cap(meta: Any, key: str) -> float | None:
    value = meta.arch_key(key, 0.0)
    return _f32(value) if value else None


def _layer_types(meta: Any, num_layers: int) -> list[str]:
    """Which layers slide: llama.cpp's per-layer flags (True: sliding) or period where the file
    has them, else its built-in period for the architecture."""
    pattern = meta.arch_key("attention.sliding_window_pattern", _DEFAULT_PATTERN[meta.arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(
                f"{meta.path}: attention.sliding_window_pattern lists {len(pattern)} layers, the "
                f"model has {num_layers}; the file is inconsistent."
            )
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    period = int(pattern)
    return [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
    ]


def _rope(meta: Any) -> dict[str, Any]:
    """Gemma 2: one rope. Gemma 3: the file's base (and linear scaling) for global layers, base
    10000 for local ones (llama.cpp's constant unless the file names another)."""
    kind = meta.arch_key("rope.scaling.type", "none")
    factor = _f32(meta.arch_key("rope.scaling.factor", 0.0) or 0.0)
    if kind not in ("none", "linear") or (kind == "linear" and meta.arch == "gemma2"):
        raise ModelLoadError(
            f"{meta.path}: rope scaling {kind!r} is not one Gemma uses (Gemma 3 scales its global "
            "layers linearly); load the original Hugging Face safetensors folder instead."
        )
    default_theta = 10_000.0 if meta.arch == "gemma2" else 1_000_000.0
    theta = _f32(meta.arch_key("rope.freq_base", default_theta))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind == "linear" and factor not in (0.0, 1.0):
        full = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if meta.arch == "gemma2":
        return full
    local_theta = _f32(meta.arch_key("rope.freq_base_swa", 10_000.0))
    return {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }


def end_of_turn_id(meta: Any) -> int | None:
    """The id of `<end_of_turn>`, with which Gemma's chat turns end (llama.cpp finds it by name;
    the file's eos is `<eos>`)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    try:
        return tokens.index(END_OF_TURN)
    except ValueError:
        return None
