"""PEFT adapters made in tests: random A and B (so they change outputs), saved as PEFT folders."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import hf_model


def make_adapter(
    base: Path,
    out: Path,
    rank: int,
    targets: list[str],
    alpha: float,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.3,
    **config,
) -> Path:
    """A PEFT LoRA folder for `base`: B drawn like A (N(0, std)), so the adapter matters."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(hf_model(base), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    """The base on Transformers (float32) with the PEFT adapter applied."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), adapter).eval()
