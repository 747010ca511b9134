"""FP8 weights on the CPU: reading each checkpoint format, quantizing on load (and dummy
weights), fused shards keeping their scales, and the errors a user can cause."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.checkpoint.quantization import fp8_checkpoint, resolve_quantization
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError, ModelLoadError
from inferengine.kernels.fp8_gemm import FP8_DTYPE, quantize_rows
from inferengine.model.layers.linear import UNQUANTIZED
from inferengine.model.loader.loader import load_model
from inferengine.model.quantization.compare import compare_logits
from inferengine.model.quantization.fp8 import Fp8LinearMethod
from tests.conftest import TINY_ARCHS
from tests.model.fp8_checkpoints import SCHEMES, quantization_config, write_fp8_pair
from tests.model.paged_runner import PagedLoop, load_tiny

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 42, 7, 230, 64, 12, 3], [250, 11, 11, 180, 9, 77, 301, 56, 2, 40, 41]]


def logits_of(model, config) -> torch.Tensor:
    """Every position's logits for PROMPTS, run as one prefill."""
    return torch.cat(PagedLoop(model, config, len(PROMPTS)).step(PROMPTS))


def load(path, quantization: str | None = None, load_format: str = "auto"):
    model, config = load_tiny(path)
    if quantization is None and load_format == "auto":
        return model, config
    config = dataclasses.replace(config, quantization=quantization, load_format=load_format)
    return load_model(config, torch.device("cpu"), TorchAttentionBackend()), config


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_checkpoint_loads_as_its_float_weights(tiny_checkpoint, tmp_path, scheme):
    """A pre-quantized checkpoint (detected from config.json) against the unquantized model on
    the weights it decodes to: per-tensor and per-channel scales are kept exactly; block
    scales are re-quantized per row (one more FP8 rounding), so only nearly."""
    fp8_dir, float_dir = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, scheme)
    fp8_model, config = load(fp8_dir)
    qkv = fp8_model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and qkv.weight.dtype == FP8_DTYPE
    got = logits_of(fp8_model, config)
    want = logits_of(*load(float_dir))
    if scheme == "hf-block":
        stats = compare_logits(want, got)
        assert stats.argmax_agreement >= 0.9 and stats.mean_kl < 0.02, stats
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["ct-channel", "hf-block"])
def test_fp8_checkpoint_equals_quantizing_its_float_weights(tiny_checkpoint, tmp_path, scheme):
    """Per-channel and block-scaled checkpoints end up exactly where `--quantization fp8` on
    the dequantized float weights does (one scale per row from the same values)."""
    fp8_dir, float_dir = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, scheme)
    got = logits_of(*load(fp8_dir))
    want = logits_of(*load(float_dir, "fp8"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_per_tensor_scales_stay_with_their_shard(tiny_checkpoint, tmp_path):
    """Fused q/k/v and gate/up: each shard's rows carry its own checkpoint tensor's scale."""
    fp8_dir, _ = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, "hf-tensor")
    from safetensors.torch import load_file

    tensors = load_file(fp8_dir / "model.safetensors")
    model, _ = load(fp8_dir)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    starts = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}
    for part, start in starts.items():
        scale = tensors[f"model.layers.1.self_attn.{part}_proj.weight_scale"]
        rows = attn.q_size if part == "q" else attn.kv_size
        assert torch.equal(attn.qkv_proj.weight_scale[start : start + rows], scale.expand(rows))
    half = mlp.gate_up_proj.weight.shape[0] // 2
    up_scale = tensors["model.layers.1.mlp.up_proj.weight_scale"]
    assert torch.equal(mlp.gate_up_proj.weight_scale[half:], up_scale.expand(half))


def test_quantize_on_load_matches_quantize_rows(tiny_checkpoint):
    """`--quantization fp8` on a float checkpoint: every projection holds quantize_rows of its
    float weight; embeddings, norms and the LM head stay float."""
    path = tiny_checkpoint("qwen2")
    ref, _ = load(path)
    model, config = load(path, "fp8")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for (name, module), (_, ref_module) in zip(
        model.named_modules(), ref.named_modules(), strict=True
    ):
        if isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
            q, scale = quantize_rows(ref_module.weight)
            assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, scale), name
    stats = compare_logits(logits_of(ref, config), logits_of(model, config))
    assert stats.argmax_agreement >= 0.85 and stats.mean_kl < 0.05, stats


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_every_architecture_runs_fp8(tiny_checkpoint, arch):
    """Quantized on load, every native architecture stays close to its float self (random
    tiny models leave many near ties, so the bound is on KL)."""
    path = tiny_checkpoint(arch)
    ref, config = load(path)
    model, _ = load(path, "fp8")
    stats = compare_logits(logits_of(ref, config), logits_of(model, config))
    assert stats.mean_kl < 0.005 and stats.argmax_agreement >= 0.8, stats
    # Each layer was built knowing its name (what a checkpoint's ignore list matches).
    named = [(n, m) for n, m in model.named_modules() if hasattr(m, "quant_method")]
    assert named and all(m.prefix == name for name, m in named), named


class FloatShapes(TorchDispatchMode):
    """The shapes of every 16/32-bit tensor any torch op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16):
                self.shapes.add(tuple(t.shape))
        return out


def test_fp8_layers_are_built_fp8(tiny_checkpoint):
    """Quantization at construction: an FP8 model's linear layers are created with FP8 weights,
    and a float checkpoint's tensors are quantized one shard at a time as they load, so no fused
    layer's full-precision weight ([gate+up, H]) ever exists; an unquantized load does make it
    (the check sees what it looks for). (Dummy weights are drawn a whole layer at a time.)"""
    _, config = load(tiny_checkpoint("qwen2"))
    with FloatShapes() as unquantized:
        load_model(config, CPU, TorchAttentionBackend())
    with FloatShapes() as fp8:
        model = load_model(dataclasses.replace(config, quantization="fp8"), CPU,
                           TorchAttentionBackend())  # fmt: skip
    linears = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)
    ]
    assert len(linears) == 4 * len(model.model.layers)
    assert all(m.weight.dtype == FP8_DTYPE for m in linears)
    shards = {(size, m.input_size) for m in linears for size in m.output_sizes}
    fused = {tuple(m.weight.shape) for m in linears} - shards  # no shard has these shapes
    assert fused and fused <= unquantized.shapes
    assert not fused & fp8.shapes, fused & fp8.shapes


def test_dummy_weights_quantize_the_unquantized_dummy_weights(tiny_checkpoint):
    """`--load-format dummy` with FP8 draws the same float weights (same seed) and quantizes
    them, so FP8 and unquantized dummy runs compare like real ones."""
    path = tiny_checkpoint("llama3-tied")
    ref, _ = load(path, None, "dummy")
    model, _ = load(path, "fp8", "dummy")
    qkv, ref_qkv = model.model.layers[2].self_attn.qkv_proj, ref.model.layers[2].self_attn.qkv_proj
    q, scale = quantize_rows(ref_qkv.weight)
    assert torch.equal(qkv.weight.float(), q.float()) and torch.equal(qkv.weight_scale, scale)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_ignored_modules_stay_unquantized(tiny_checkpoint, tmp_path):
    fp8_dir, float_dir = write_fp8_pair(
        tiny_checkpoint("qwen2"), tmp_path, "ct-channel", ignore=("down_proj",)
    )
    model, config = load(fp8_dir)
    down = model.model.layers[0].mlp.down_proj
    assert down.quant_method is UNQUANTIZED and down.weight.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.quant_method, Fp8LinearMethod)
    want = logits_of(*load(float_dir))
    torch.testing.assert_close(logits_of(model, config), want, atol=1e-4, rtol=1e-4)


def test_missing_weight_scales_fail_loading(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_dir, _ = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, "ct-channel")
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.qkv_proj.*weight scales"):
        load(fp8_dir)


def test_mixture_of_experts(tiny_checkpoint, tmp_path):
    """Quantized on load: attention FP8, experts unquantized. An FP8 MoE checkpoint: refused."""
    path = tiny_checkpoint("mixtral")
    model, config = load(path, "fp8")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    stats = compare_logits(logits_of(*load(path)), logits_of(model, config))
    assert stats.argmax_agreement >= 0.8, stats
    hf = dict(config.hf_config, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        load_model(
            dataclasses.replace(config, hf_config=hf), torch.device("cpu"), TorchAttentionBackend()
        )


# ---- formats and flags ------------------------------------------------------------------------


def test_checkpoint_formats_parse():
    assert fp8_checkpoint({}) is None
    block = fp8_checkpoint(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert block.weight_scales == "block" and block.block_size == (128, 128)
    tensor = fp8_checkpoint(
        {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                 "ignored_layers": ["lm_head"]}}
    )  # fmt: skip
    assert tensor.weight_scales == "tensor" and tensor.static_input_scales
    assert tensor.ignores(["lm_head"]) and not tensor.ignores(["model.layers.0.mlp.gate_proj"])
    ct = fp8_checkpoint({"quantization_config": quantization_config("ct-channel", ["re:.*gate$"])})
    assert ct.method == "compressed-tensors" and ct.weight_scales == "channel"
    assert ct.ignores(["model.layers.3.mlp.gate"]) and not ct.ignores(
        ["model.layers.3.mlp.gate_up"]
    )


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4},
                                  "input_activations": {"num_bits": 8}}}}, "w4a8"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}}, "int/8"),
    ],
)  # fmt: skip
def test_unsupported_checkpoint_quantization_is_refused(qc, message):
    with pytest.raises(ConfigError, match=message) as info:
        fp8_checkpoint({"quantization_config": qc})
    assert "supported" in str(info.value)


def test_quantization_flag():
    assert resolve_quantization(None, {}) is None
    assert resolve_quantization("none", {}) is None
    assert resolve_quantization("FP8", {}) == "fp8"
    fp8_config = {"quantization_config": {"quant_method": "fp8"}}
    assert resolve_quantization(None, fp8_config) == "fp8"
    with pytest.raises(ConfigError, match=r"one of none, fp8; got 'int8'"):
        resolve_quantization("int8", {})
    with pytest.raises(ConfigError, match="drop --quantization none"):
        resolve_quantization("none", fp8_config)
    with pytest.raises(ConfigError, match="Transformers fallback"):
        resolve_quantization("fp8", {}, native=False)


def test_engine_args_quantization(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2"))
    config = EngineArgs(model=path, quantization="fp8", device="cpu").create_engine_config()
    assert config.model_config.quantization == "fp8"
    assert (
        EngineArgs(model=path, device="cpu").create_engine_config().model_config.quantization
        is None
    )
    with pytest.raises(ConfigError, match="--quantization must be one of"):
        EngineArgs(model=path, quantization="gptq", device="cpu").create_engine_config()


def test_engine_args_refuses_fp8_on_the_transformers_fallback(tiny_checkpoint):
    args = EngineArgs(
        model=str(tiny_checkpoint("qwen2")), quantization="fp8", model_impl="transformers",
        device="cpu",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="Transformers fallback"):
        args.create_engine_config()


def test_cli_flag(tiny_checkpoint):
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args([str(tiny_checkpoint("qwen2")), "--quantization", "fp8"])
    assert EngineArgs.from_cli_args(args).quantization == "fp8"


def test_config_json_fp8_detected_by_engine_args(tiny_checkpoint, tmp_path):
    fp8_dir, _ = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, "ct-tensor")
    config = EngineArgs(model=str(fp8_dir), device="cpu").create_engine_config()
    assert config.model_config.quantization == "fp8"
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_norms_hand_fp8_activations_only_to_their_sole_reader(tiny_checkpoint, monkeypatch, arch):
    """As on a GPU past the W8A16 range (here with torch stand-ins for the kernels): the RMSNorm
    before qkv_proj and a dense gate_up_proj hands them FP8 activations; no other linear ever
    gets one (Gemma's norms and MoE blocks keep the plain path), and the logits change only by
    the activations' rounding."""
    from inferengine.kernels import norm as norm_kernels
    from inferengine.kernels.fp8_gemm import Fp8Input, per_token_quant_ref
    from inferengine.model.layers import norm as norm_layer

    path = tiny_checkpoint(arch)
    model, config = load(path, "fp8")
    plain = logits_of(model, config)

    def rms_norm_fp8(x, weight, eps, residual=None):
        if residual is None:
            normed = norm_kernels.rms_norm_ref(x, weight, eps)
        else:
            normed, residual = norm_kernels.fused_add_rms_norm_ref(x.clone(), residual, weight, eps)
        q, scale = per_token_quant_ref(normed.reshape(-1, x.shape[-1]))
        return Fp8Input(q, scale, x.shape, x.dtype), residual

    names = {id(m): name for name, m in model.named_modules()}

    def short(layer) -> str:  # "qkv_proj@3": the projection and its layer
        parts = names[id(layer)].split(".")
        return f"{parts[-1]}@{parts[2]}"

    asked: set[str] = set()
    handed: set[str] = set()
    apply = Fp8LinearMethod.apply

    def recording_apply(self, layer, x, bias):
        if isinstance(x, Fp8Input):
            handed.add(short(layer))
        return apply(self, layer, x, bias)

    def takes_fp8_input(self, layer, x) -> bool:
        asked.add(short(layer))
        return True

    monkeypatch.setattr(norm_layer, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(norm_kernels, "rms_norm", norm_kernels.rms_norm_ref)
    monkeypatch.setattr(norm_kernels, "fused_add_rms_norm", norm_kernels.fused_add_rms_norm_ref)
    monkeypatch.setattr(norm_kernels, "rms_norm_fp8", rms_norm_fp8)
    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_input", takes_fp8_input)
    monkeypatch.setattr(Fp8LinearMethod, "apply", recording_apply)
    fused = logits_of(model, config)

    layers = len(model.model.layers)
    assert asked == handed  # the norm asks the linear that then reads its output
    kinds = {h.split("@")[0] for h in handed}
    assert kinds <= {"qkv_proj", "gate_up_proj"}, handed
    if arch.startswith("gemma"):
        assert not handed
    else:
        assert {f"qkv_proj@{i}" for i in range(layers)} <= handed, handed
        dense = [
            i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate_up_proj")
        ]
        assert {f"gate_up_proj@{i}" for i in dense} == {h for h in handed if "gate_up" in h}
    stats = compare_logits(plain, fused)
    assert stats.mean_kl < 0.01, stats
