"""Which integer formats and options a checkpoint's quantization_config may name: what each
parses to, every option we cannot serve refused at start-up by name, and the load's own
refusals (shapes that do not pack, act-order parts that disagree, experts)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from inferengine.checkpoint.int_quant import IntCheckpoint
from inferengine.checkpoint.quantization import (
    fp8_checkpoint,
    int_quant_checkpoint,
    resolve_quantization,
)
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError, ModelLoadError
from inferengine.kernels.int4_gemm import AWQ_PACK_ORDER, pack_int32, unpack_int32
from inferengine.model.quantization.int_weights import IntLinearMethod
from tests.model.paged_runner import PagedLoop, load_tiny
from tests.model.quantization.int_checkpoints import Scheme, pack_along, write_int_pair


def parse(qc: dict) -> IntCheckpoint | None:
    return int_quant_checkpoint({"quantization_config": qc})


def ct(weights: dict, **group) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights, **group}}}  # fmt: skip


W4 = {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 128}


def test_supported_configs_parse():
    awq = parse({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                 "version": "GEMM", "modules_to_not_convert": ["visual"]})  # fmt: skip
    assert awq == IntCheckpoint("awq", 4, 128, symmetric=False, ignore=("visual",))
    gptq = parse({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False,
                  "desc_act": True})  # fmt: skip
    assert (gptq.bits, gptq.group_size, gptq.symmetric, gptq.act_order) == (8, -1, False, True)
    assert gptq.zeros_offset == 1  # v1: zeros stored minus one
    assert (
        parse({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}).zeros_offset == 0
    )
    w4 = parse(ct(W4) | {"ignore": ["lm_head", "re:.*down_proj"]})
    assert (w4.method, w4.bits, w4.group_size, w4.act_order) == (
        "compressed-tensors",
        4,
        128,
        False,
    )
    assert not w4.quantizes(["model.layers.0.mlp.down_proj"])
    assert w4.quantizes(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"])
    channel = parse(ct({"type": "int", "num_bits": 8, "strategy": "channel", "actorder": "group"}))
    assert (channel.group_size, channel.act_order) == (-1, True)
    # FP8 checkpoints are not integer ones, and the reverse.
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}}  # fmt: skip
    assert parse(fp8) is None and fp8_checkpoint({"quantization_config": fp8}) is not None
    assert fp8_checkpoint({"quantization_config": ct(W4)}) is None


@pytest.mark.parametrize(
    "qc, named",
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "'gemv_fast'"),
        ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "'exllama'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point false"),
        ({"quant_method": "awq", "bits": 3}, "AWQ bits 3"),
        ({"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size -1"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ bits 3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "format": "bitblas"}, "'bitblas'"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*": {}}}, "dynamic"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
        ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head true"),
        (ct(W4 | {"symmetric": False}), "asymmetric"),
        (ct(W4, input_activations={"num_bits": 8, "type": "int"}), "w4a8"),
        (ct(W4 | {"strategy": "tensor"}), "'tensor'"),
        (ct(W4 | {"actorder": "dynamic"}), "'dynamic'"),
        (ct(W4 | {"num_bits": 2}), "int/2 bits"),
        (ct(W4) | {"config_groups": {"a": {"weights": W4},
                                     "b": {"weights": W4 | {"num_bits": 8}}}}, "mixing"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "'int-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "mixed-precision"}, "mixed-precision"),
    ],
)  # fmt: skip
def test_unsupported_options_are_named(qc, named):
    with pytest.raises(ConfigError, match=named) as info:
        fp8_checkpoint({"quantization_config": qc})  # what start-up asks first
    assert "supported" in str(info.value)


def test_quantization_of_a_run():
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    assert resolve_quantization(None, awq) == "awq"
    ct_config = {"quantization_config": ct(W4)}
    assert resolve_quantization(None, ct_config) == "compressed-tensors"
    for flag in ("fp8", "none"):
        with pytest.raises(ConfigError, match=f"drop --quantization {flag}"):
            resolve_quantization(flag, awq)
    with pytest.raises(ConfigError, match="Transformers fallback"):
        resolve_quantization(None, awq, native=False)
    # Phi-3 stores qkv_proj and gate_up_proj fused: packed words cannot be split as floats are
    phi3 = awq | {"architectures": ["Phi3ForCausalLM"]}
    with pytest.raises(ConfigError, match="stores qkv_proj and gate_up_proj fused"):
        resolve_quantization(None, phi3)


def test_engine_args_take_the_checkpoint_format(float_source, tmp_path):
    q_dir, _ = write_int_pair(float_source("qwen2"), tmp_path, Scheme("awq", 4, 32), "awq")
    config = EngineArgs(model=str(q_dir), device="cpu").create_engine_config()
    assert config.model_config.quantization == "awq"
    with pytest.raises(ConfigError, match="drop --quantization fp8"):
        EngineArgs(model=str(q_dir), device="cpu", quantization="fp8").create_engine_config()


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        values = torch.randint(0, 1 << bits, (64, 24), generator=g, dtype=torch.uint8)
        for dim in (0, 1):
            words = pack_int32(values, bits, dim)
            assert torch.equal(words, pack_along(values, bits, dim))  # the test's own packing
            assert torch.equal(unpack_int32(words, bits, dim), values)
    values = torch.randint(0, 16, (8, 16), generator=g, dtype=torch.uint8)
    awq = pack_along(values, 4, 1, list(AWQ_PACK_ORDER))
    assert torch.equal(unpack_int32(awq, 4, dim=1, order=AWQ_PACK_ORDER), values)


def test_dummy_weights_load_and_run(float_source, tmp_path):
    """--load-format dummy: random packed values, small scales, groups in order."""
    q_dir, _ = write_int_pair(
        float_source("qwen2"), tmp_path, Scheme("gptq", 4, 32, desc_act=True), "gptq"
    )
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.model.loader.loader import load_model

    _, config = load_tiny(q_dir)
    config = dataclasses.replace(config, load_format="dummy")
    model = load_model(config, torch.device("cpu"), TorchAttentionBackend())
    logits = PagedLoop(model, config, 1).step([[5, 6, 7, 8]])[0]
    assert torch.isfinite(logits).all()


def test_load_refusals(float_source, tmp_path):
    src = float_source("qwen2")
    # Groups of 256 do not divide the 128 hidden features.
    q_dir, _ = write_int_pair(src, tmp_path, Scheme("gptq", 4, 128, sym=True), "g128")
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"]["group_size"] = 256
    (q_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not whole groups of 256"):
        load_tiny(q_dir)
    # Fused parts quantized with different act-order groups.
    from safetensors.torch import load_file, save_file

    q_dir, _ = write_int_pair(src, tmp_path, Scheme("gptq", 4, 32, desc_act=True), "act")
    tensors = load_file(q_dir / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, q_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="different g_idx"):
        load_tiny(q_dir)


def test_ignored_layers_stay_float(float_source, tmp_path):
    q_dir, _ = write_int_pair(float_source("qwen2"), tmp_path, Scheme("awq", 4, 32), "awq")
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (q_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="down_proj"):  # its float weight is missing
        load_tiny(q_dir)
    config["quantization_config"]["modules_to_not_convert"] = None
    (q_dir / "config.json").write_text(json.dumps(config))
    model, _ = load_tiny(q_dir)
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, IntLinearMethod)
    assert model.lm_head.weight.dtype == torch.float32


def test_extra_zero_biases_are_read_past(float_source, tmp_path):
    """AutoGPTQ saves a bias for every projection; where the model has none it is skipped."""
    from safetensors.torch import load_file, save_file

    scheme = Scheme("gptq", 4, 32, sym=True)
    q_dir, _ = write_int_pair(float_source("qwen2"), tmp_path, scheme, "gptq")
    tensors = load_file(q_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".scales")]:
        bias = name.replace(".scales", ".bias")
        tensors.setdefault(bias, torch.zeros(tensors[name].shape[1]))
    save_file(tensors, q_dir / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_tiny(q_dir)
    assert model.model.layers[0].mlp.down_proj.bias is None
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's own, loaded
