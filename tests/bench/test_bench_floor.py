"""The decode bandwidth floor counts what a decode step reads: Transformers' parameters minus the
input embedding (unless tied), plus the context's KV and one embedding row per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferengine.bench.floor import batch1_floor, decode_step_bytes

QWEN = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-7b"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 32}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3", {"head_dim": 32, "attention_bias": True}),
    ],
)
def test_weight_bytes_are_transformers_parameters_minus_the_input_embedding(model_type, extra):
    import transformers

    config = {"model_type": model_type, **TINY, **extra}
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    params = {name: p.numel() for name, p in model.named_parameters()}  # tied: counted once
    embedding = params.pop("model.embed_tokens.weight")
    read = sum(params.values()) + (embedding if extra.get("tie_word_embeddings") else 0)
    counted = decode_step_bytes(config, batch=1, context_len=0, dtype_bytes=2)
    assert counted.weights == 2 * read


def test_kv_and_embedding_rows_scale_with_batch_and_context():
    config = {"model_type": "llama", **TINY}
    one = decode_step_bytes(config, 1, 100, 2)
    four = decode_step_bytes(config, 4, 100, 2)
    kv_per_token = 3 * 2 * (2 * 16) * 2  # layers x (K, V) x kv heads x head dim x bytes
    assert one.kv_cache == 100 * kv_per_token and four.kv_cache == 4 * one.kv_cache
    assert one.embedding_rows == 64 * 2 and four.weights == one.weights


def test_qwen25_7b_floor_leaves_out_the_embedding(tmp_path):
    config = json.loads((QWEN / "config.json").read_text())
    counted = decode_step_bytes(config, 1, 320, 2)
    embedding = config["vocab_size"] * config["hidden_size"] * 2
    assert 14.1e9 < counted.weights < 14.2e9  # 15.2 GB of parameters minus 1.09 GB embedding
    floor = batch1_floor(QWEN, 256, 128, copy_gbps=3000.0)
    assert floor["context_len"] == 320
    assert floor["floor_ms"] == pytest.approx(floor["bytes"]["total"] / 3e12 * 1e3)
    assert floor["bytes"]["total"] < counted.weights + embedding


def test_floor_says_why_it_is_missing(tmp_path):
    assert "no CUDA" in batch1_floor(QWEN, 1, 1, None)["reason"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert "mixtral" in batch1_floor(tmp_path, 1, 1, 3000.0)["reason"]


def test_llama3_70b_floor_at_tp2_is_one_ranks_half():
    config = json.loads((QWEN.parent / "llama-3-70b" / "config.json").read_text())
    whole = decode_step_bytes(config, 1, 0, 2)
    rank = decode_step_bytes(config, 1, 0, 2, tp=2)
    # [12]'s 70.6 GB per GPU, less the rank's 1.05 GB half of the input embedding (not read)
    assert 69.4e9 < rank.weights < 69.6e9
    norms = (2 * config["num_hidden_layers"] + 1) * config["hidden_size"] * 2  # kept whole
    assert rank.weights == (whole.weights - norms) / 2 + norms


def test_kv_heads_are_kept_whole_when_ranks_outnumber_them():
    config = {"model_type": "llama", **TINY}  # 2 KV heads
    kv_per_token = 3 * 2 * 16 * 2  # layers x (K, V) x one head's dim x bytes
    assert decode_step_bytes(config, 1, 100, 2, tp=4).kv_cache == 100 * kv_per_token


@pytest.mark.parametrize(
    "command, size",
    [
        ("serve m --tensor-parallel-size 2 --x 1", 2),
        ("serve m --tensor-parallel-size=4", 4),
        ("serve m -tp 8", 8),
        ("serve m", 1),
        (None, 1),
    ],
)
def test_tensor_parallel_size_read_from_the_server_command(command, size):
    from inferengine.bench.paired import tensor_parallel_size

    assert tensor_parallel_size(command) == size


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    ],
)
def test_fp8_weights_count_a_byte_a_projection_weight_and_a_scale_a_row(model_type, extra):
    """FP8 quantizes the attention and MLP projections (one byte a weight, a float32 scale per
    output row); biases, norms and the LM head stay 16-bit. Counted from Transformers' modules."""
    import transformers

    config = {"model_type": model_type, **TINY, **extra}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    expected = 0
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if name == "model.embed_tokens.weight" and not extra.get("tie_word_embeddings"):
            continue
        quantized = name.endswith(".weight") and name.split(".")[-2] in projections
        expected += p.numel() + 4 * p.shape[0] if quantized else 2 * p.numel()
    counted = decode_step_bytes(config, 1, 0, 2, fp8_weights=True)
    assert counted.weights == expected


def test_fp8_kv_cache_counts_a_byte_an_element():
    config = {"model_type": "llama", **TINY}
    full = decode_step_bytes(config, 2, 100, 2)
    fp8 = decode_step_bytes(config, 2, 100, 2, fp8_kv=True)
    assert fp8.kv_cache * 2 == full.kv_cache and fp8.weights == full.weights


def test_formats_come_from_the_server_flags_or_an_fp8_checkpoint(tmp_path):
    from inferengine.bench.floor import fp8_formats

    assert fp8_formats("serve m --quantization fp8 --kv-cache-dtype fp8") == (True, True)
    assert fp8_formats("serve m --quantization=FP8 --kv-cache-dtype=fp8_e5m2") == (True, True)
    assert fp8_formats("serve m -q fp8 --quantization none") == (False, False)  # the last wins
    assert fp8_formats("serve m --kv-cache-dtype auto") == (False, False)
    assert fp8_formats(None) == (False, False)
    fp8_config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(fp8_config))
    assert fp8_formats("serve m", tmp_path) == (True, False)  # the checkpoint says FP8
    assert fp8_formats("serve m", QWEN) == (False, False)


def test_fp8_floor_halves_the_projections_and_the_kv_but_not_the_head():
    qwen = json.loads((QWEN / "config.json").read_text())
    bf16 = batch1_floor(QWEN, 256, 128, copy_gbps=3000.0)
    fp8 = batch1_floor(QWEN, 256, 128, copy_gbps=3000.0, fp8_weights=True, fp8_kv=True)
    h, layers = qwen["hidden_size"], qwen["num_hidden_layers"]
    head = qwen["vocab_size"] * h * 2
    kv, inter = (
        qwen["num_key_value_heads"] * h // qwen["num_attention_heads"],
        qwen["intermediate_size"],
    )
    projections = layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    scales = layers * 4 * (2 * h + 2 * kv + 2 * inter + h)
    assert bf16["bytes"]["weights"] - fp8["bytes"]["weights"] == projections - scales
    assert fp8["bytes"]["kv_cache"] * 2 == bf16["bytes"]["kv_cache"]
    assert fp8["bytes"]["weights"] > projections + head  # the head stays 16-bit


def test_paired_floor_is_missing_when_the_servers_store_different_formats():
    from types import SimpleNamespace

    from inferengine.bench.paired import floor_entry

    dataset = SimpleNamespace(random_prefix_len=0, random_input_len=256, random_output_len=128)
    systems = {s: {"spread": {"median_tpot_ms": {"median": 4.0}}} for s in ("a", "b")}

    def entry(commands):
        specs = [SimpleNamespace(command=c) for c in commands]
        cfg = SimpleNamespace(systems=specs, model_dir=str(QWEN))
        return floor_entry(cfg, SimpleNamespace(dataset=dataset), {"systems": systems}, 3000.0)

    mixed = entry(["serve --quantization fp8", "serve"])
    assert mixed["floor_ms"] is None and "different formats" in mixed["reason"]
    same = entry(["serve --quantization fp8 --kv-cache-dtype fp8"] * 2)
    expected = batch1_floor(QWEN, 256, 128, 3000.0, fp8_weights=True, fp8_kv=True)["floor_ms"]
    assert same["floor_ms"] == pytest.approx(expected)
    assert same["tpot_over_floor"]["a"] == pytest.approx(4.0 / expected)
