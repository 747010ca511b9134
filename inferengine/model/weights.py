"""Reading checkpoint tensors and placing them into a model's (fused) parameters."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inferengine.errors import ModelLoadError
from inferengine.model.layers.linear import default_weight_loader, shape_of


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files, from `model.safetensors.index.json` when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(
                f"{index} lists shards that are not in {model_dir}: {', '.join(missing)}. "
                "Download the missing files, or the whole folder again."
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir}. Point --model at a folder with the weights, "
            "use a .gguf file, or pass --load-format dummy for random weights."
        )
    return files


def iterate_safetensors(
    model_dir: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, Any]]:
    """Each checkpoint tensor as a safetensors slice that is read when indexed, so a
    tensor-parallel rank reads only its shard; tensors `wanted` refuses are not read at all."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if wanted is None or wanted(name):
                        yield name, f.get_slice(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"cannot read {path}: it is truncated or corrupt ({e}). Download it again."
            ) from e


class RowRange:
    """Rows `[start, start + length)` of a checkpoint tensor (a torch tensor or a safetensors
    slice), read only when indexed: a fused tensor's part, which a rank reads only its shard of."""

    def __init__(self, source: Any, start: int, length: int):
        self.source, self.start, self.length = source, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *shape_of(self.source)[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        assert isinstance(rows, slice) and rows.step in (None, 1), "rows must be a plain slice"
        first, last, _ = rows.indices(self.length)
        return self.source[(slice(self.start + first, self.start + last), *rest)]


def split_fused_rows(
    weights: Iterable[tuple[str, Any]], fused: dict[str, list[tuple[str, int]]]
) -> Iterator[tuple[str, Any]]:
    """Each checkpoint tensor named `....{fused_part}.{weight|bias}` as its row blocks, renamed to
    the unfused parts (e.g. Phi-3's `qkv_proj` → `q_proj`, `k_proj`, `v_proj`), so the usual
    stacked-parameter routing places them."""
    for name, tensor in weights:
        for part, pieces in fused.items():
            if f".{part}." in name:
                rows = shape_of(tensor)[0]
                if rows != sum(size for _, size in pieces):
                    raise ModelLoadError(
                        f"checkpoint tensor {name} has {rows} rows, but config.json implies "
                        f"{' + '.join(str(size) for _, size in pieces)}; is config.json the "
                        "one that belongs to these weights?"
                    )
                start = 0
                for piece, size in pieces:
                    yield name.replace(f".{part}.", f".{piece}."), RowRange(tensor, start, size)
                    start += size
                break
        else:
            yield name, tensor


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    stacked_params: Iterable[tuple[str, str, int | str]],
    skip_suffixes: tuple[str, ...] = (),
    route: Callable[[str], tuple[str, Any] | None] | None = None,
) -> None:
    """Copy HF-named tensors into `model`, routing q/k/v and gate/up into fused parameters.

    `route(name)`, when given, is asked first: a model's own `(parameter name, shard id)` for a
    checkpoint tensor (e.g. one expert of a mixture-of-experts layer), or None.
    Every parameter must be filled; a missing one means a truncated or mismatched checkpoint.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        routed = route(name) if route is not None else None
        if routed is not None:
            target, shard_id = routed
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
            _load(params[target], tensor, name, shard_id)
            loaded.add(target)
            continue
        for hf_part, our_part, shard_id in stacked_params:
            if f".{hf_part}." in name:
                target = name.replace(f".{hf_part}.", f".{our_part}.")
                if target not in params:
                    raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
                _load(params[target], tensor, name, shard_id)
                loaded.add(f"{target}#{shard_id}")
                loaded.add(target)
                break
        else:
            if name not in params:
                raise ModelLoadError(
                    f"checkpoint tensor {name} has no place in the model; is config.json "
                    "the one that belongs to these weights?"
                )
            _load(params[name], tensor, name, None)
            loaded.add(name)
    # named_parameters() lists a tied parameter once, under its first name. A parameter
    # marked `optional_in_checkpoint` (an FP8 scale computed on load) is checked by its layer.
    missing = sorted(
        name
        for name in set(params) - loaded
        if not getattr(params[name], "optional_in_checkpoint", False)
    )
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors the model needs ({shown}); "
            "the download is incomplete or belongs to another model."
        )


def _load(param: nn.Parameter, tensor: Any, name: str, shard_id: Any) -> None:
    """`tensor`: a torch tensor or a safetensors slice; `copy_` converts the dtype."""
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            default_weight_loader(param, tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise ModelLoadError(f"cannot load {name}: {e}") from e


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights at the model's real shapes, for benchmarks (`--load-format dummy`).

    Norm weights are 1 and the rest small normal values, so activations stay finite and the
    sampled tokens vary like a real model's would. A quantized weight is drawn in its model's
    dtype and handed to its `quantize_from`, so an FP8 model quantizes the very weights the
    unquantized model with the same seed gets.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if getattr(param, "optional_in_checkpoint", False):
            continue  # filled with the weight it belongs to
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        generator = generators[param.device]
        dummy_init = getattr(param, "dummy_init", None)  # packed integer weights fill themselves
        if dummy_init is not None:
            dummy_init(generator)
            continue
        quantize_from = getattr(param, "quantize_from", None)
        if quantize_from is None:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            drawn = torch.empty(param.shape, dtype=param.dummy_dtype, device=param.device)
            quantize_from(drawn.normal_(0.0, 0.02, generator=generator))
