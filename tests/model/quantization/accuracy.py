"""Int4 accuracy on a real model: SmolLM2-135M (the default model's GGUF, dequantized to
float32) quantized here by round-to-nearest into a format's layout, loaded by the engine, and
compared with the float model on greedy continuations of real text (teacher-forced: both
models score the float model's continuation; argmax agreement and KL on those positions)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from torch import nn

from inferengine.model.quantization.compare import LogitAgreement, compare_logits
from tests.model.paged_runner import PagedLoop, load_tiny
from tests.model.quantization.int_checkpoints import Scheme, write_quantized

TEXTS = (
    "The capital of France is Paris. It is known for",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea, there lived",
)


def log(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)


def cached_default_model() -> Path | None:
    """The default model's converted folder, if this machine has it (nothing is downloaded)."""
    from inferengine import envs
    from inferengine.checkpoint.aliases import DEFAULT_MODEL, READY_MARKER

    folder = Path(envs.cache_dir()) / "models" / DEFAULT_MODEL
    return folder if (folder / READY_MARKER).exists() else None


def hf_named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A loaded Llama's weights under the checkpoint's names (fused q/k/v, gate/up split)."""
    out = {}
    for name, p in model.state_dict().items():
        if ".qkv_proj." in name:
            attn = model.model.layers[int(name.split(".")[2])].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            for part, piece in zip(("q", "k", "v"), p.split(sizes), strict=True):
                out[name.replace("qkv_proj", f"{part}_proj")] = piece.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif not name.startswith("lm_head") and p.is_floating_point():
            out[name] = p.contiguous()
    return out


def float_reference(folder: Path, steps: int = 32):
    """(float32 model, its config, prompts, prompts + the model's greedy continuations)."""
    from transformers import AutoTokenizer

    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.checkpoint.resolve import resolve_model
    from inferengine.config import ModelConfig
    from inferengine.model.loader.loader import load_model

    resolved = resolve_model(str(folder))
    config = ModelConfig(
        model=str(folder), model_path=str(resolved.path), hf_config=resolved.hf_config,
        dtype="float32", max_model_len=256, load_format=resolved.load_format,
        gguf_dequantize=True,
    )  # fmt: skip
    model = load_model(config, torch.device("cpu"), TorchAttentionBackend())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    loop = PagedLoop(model, config, len(prompts))
    logits = loop.step(prompts)
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = [[int(lg[-1].argmax())] for lg in logits]
        for seq, token in zip(seqs, nxt, strict=True):
            seq.extend(token)
        logits = loop.step(nxt)
    log("float model and its continuations")
    return model, config, prompts, seqs


def measure(folder: Path, out: Path, scheme: Scheme, reference=None) -> LogitAgreement:
    """`scheme` on the real model against its float32 self (`reference`: `float_reference`'s
    result, computed when not given)."""
    model, config, prompts, seqs = reference or float_reference(folder)
    hf_config = {k: v for k, v in config.hf_config.items() if k != "quantization_config"}
    q_dir = write_quantized(hf_named_tensors(model), hf_config, out, scheme)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (folder / name).exists():
            shutil.copy(folder / name, q_dir / name)
    log(f"{scheme} quantized and written")
    q_model, q_config = load_tiny(q_dir)
    ref = PagedLoop(model, config, len(seqs)).step(seqs)
    got = PagedLoop(q_model, q_config, len(seqs)).step(seqs)
    # The continuation's positions: each predicts a token the float model chose.
    ref_c = torch.cat([r[len(p) - 1 : -1] for r, p in zip(ref, prompts, strict=True)])
    got_c = torch.cat([g[len(p) - 1 : -1] for g, p in zip(got, prompts, strict=True)])
    return compare_logits(ref_c, got_c)


def parse_scheme(spec: str) -> Scheme:
    """`method:group[:bits]`, e.g. awq:64, gptq:128:8 (GPTQ symmetric)."""
    method, group, bits = (spec + ":4").split(":")[:3]
    return Scheme(method, int(bits), int(group), sym=method == "gptq")
