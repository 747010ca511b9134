"""AWQ, GPTQ and compressed-tensors checkpoints on the CPU: each layer's weights decode to what
the format's own reading gives, and greedy tokens equal Transformers' (float32) running the
dequantized float weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from inferengine.kernels.int4_gemm import dequantize_ref
from inferengine.model.quantization.int_weights import IntLinearMethod
from tests.conftest import build_checkpoint, hf_greedy, hf_model
from tests.model.paged_runner import PagedLoop, load_tiny
from tests.model.quantization.int_checkpoints import Scheme, reference_dequantize, write_int_pair

SCHEMES = {
    "awq-g128": Scheme("awq", 4, 128),
    "awq-g32": Scheme("awq", 4, 32),
    "gptq-4bit-sym": Scheme("gptq", 4, 128, sym=True),
    "gptq-4bit-asym-act-order": Scheme("gptq", 4, 32, sym=False, desc_act=True),
    "gptq-8bit": Scheme("gptq", 8, 64, sym=True, version="gptq_v2"),
    "ct-w4a16": Scheme("compressed-tensors", 4, 32),
    "ct-w8a16-channel": Scheme("compressed-tensors", 8, -1),
    "ct-w4a16-act-order": Scheme("compressed-tensors", 4, 64, desc_act=True),
}
# Inputs of 128 (hidden) and 256 (MLP) features: whole groups of 128.
SHAPE = dict(hidden_size=128, intermediate_size=256)
PROMPTS_LEN = (5, 19, 40)


@pytest.fixture(scope="module")
def float_source(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) and Llama (untied head) with 128-wide hidden states."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(arch), **SHAPE)
        return cache[arch]

    return get


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in PROMPTS_LEN]


def _greedy(model, config, prompts, steps: int) -> list[list[int]]:
    loop = PagedLoop(model, config, num_seqs=len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    logits = loop.step(prompts)
    for _ in range(steps):
        nxt = [[int(lg[-1].argmax())] for lg in logits]
        for tokens, token in zip(out, nxt, strict=True):
            tokens.extend(token)
        logits = loop.step(nxt)
    return out


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_int_checkpoint_greedy_equals_transformers_on_dequantized(float_source, tmp_path, name):
    scheme = SCHEMES[name]
    arch = "llama2-bias" if scheme.method == "gptq" else "qwen2"
    q_dir, float_dir = write_int_pair(float_source(arch), tmp_path, scheme, name)
    model, config = load_tiny(q_dir)
    methods = [m.quant_method for m in model.modules() if hasattr(m, "quant_method")]
    assert methods and all(isinstance(m, IntLinearMethod) for m in methods)
    # Every layer decodes to the format's own reading of its checkpoint tensors.
    tensors = load_file(q_dir / "model.safetensors")
    layer = model.model.layers[1]
    for ours, parts in (
        (layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
        (layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
        (layer.mlp.down_proj, ("down_proj",)),
    ):
        want = []
        for part in parts:
            module = "self_attn" if part[0] in "qkvo" else "mlp"
            prefix = f"model.layers.1.{module}.{part}."
            layer_tensors = {k.removeprefix(prefix): v for k, v in tensors.items()
                             if k.startswith(prefix)}  # fmt: skip
            want.append(reference_dequantize(scheme, layer_tensors))
        got = dequantize_ref(ours.quant_method.weights(ours)).t()
        torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=0)
    # Same greedy tokens as Transformers on the dequantized weights, and close logits.
    prompts = _prompts()
    reference = hf_model(float_dir)
    expected = [hf_greedy(reference, p, 12) for p in prompts]
    assert _greedy(model, config, prompts, 12) == expected
    with torch.no_grad():
        want_logits = reference(torch.tensor([prompts[1]])).logits[0]
    got_logits = PagedLoop(model, config, 1).step([prompts[1]])[0]
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
