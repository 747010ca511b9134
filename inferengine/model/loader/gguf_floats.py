"""Which float weights a converted GGUF folder keeps, and the rest written when a load reads them.

A GGUF converted for the model cache (`convert_gguf(..., lean=True)`: the aliases and `.gguf`
paths) gets float32 copies (`model-floats.safetensors`) only of the tensors the CPU's quantized
path reads as floats: norms, weights of types our kernels do not take, and every shard of a
fused layer (q/k/v, gate/up) that cannot stay quantized whole. The linear weights, LM head and
token embedding our kernels run from the GGUF's own blocks (`gguf_quantized.py`) get none.

A load that reads any of the left-out weights as floats (on CUDA, with --gguf-dequantize or
--quantization, split over tensor-parallel ranks, on a CPU without our kernels) has them all
written once, under a lock, to `model-dense.safetensors`, and then an index over both files
(`model.safetensors.index.json`), so the folder is a complete checkpoint from then on (one that
Transformers reads too; before, it has no `model.safetensors` for Transformers to take for whole).
The two files never share a tensor, so a reader that lists the folder between the two writes
still reads each tensor once.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger
from inferengine.model.loader.gguf import _hf_name, _layout, _open, _write_weights
from inferengine.model.loader.gguf_source import FLOATS_FILE, GGUFSource, has_source

logger = init_logger(__name__)

DENSE_FILE = "model-dense.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _names_in(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def ensure_float_weights(folder: Path, wanted: Callable[[str], bool] | None = None) -> None:
    """Before a load of converted GGUF `folder` that reads checkpoint names `wanted` accepts
    (None: all): write the float weights the folder left out if the load reads any of them."""
    if not has_source(folder) or (folder / INDEX_FILE).exists():
        return
    source = GGUFSource(folder)
    roles = _layout(source.architecture).layer_tensors
    present = {n for path in folder.glob("*.safetensors") for n in _names_in(path)}
    left_out = {
        name: hf
        for name in source.tensors
        if (hf := _hf_name(name, roles)) is not None and hf not in present
    }
    if not any(wanted is None or wanted(hf) for hf in left_out.values()):
        return
    try:
        with open(folder / ".model-dense.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not (folder / INDEX_FILE).exists():  # another process may have written it
                    _write_dense(folder, set(left_out), source.architecture)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as e:
        raise ModelLoadError(
            f"{folder} keeps float weights only for the CPU's quantized path, and writing the "
            f"others this load reads failed ({e}); make the folder writable, or convert the "
            ".gguf again."
        ) from e


def _write_dense(folder: Path, names: set[str], architecture: str) -> None:
    """`names` (GGUF names) dequantized to `model-dense.safetensors`, then the index."""
    source_path = folder / "model.gguf"
    logger.info(
        "%s: writing the float32 weights of %d GGUF tensors for a load that reads them as "
        "floats (once)",
        folder,
        len(names),
    )
    reader = _open(source_path)
    tensors = {t.name: t for t in reader.tensors if t.name in names}
    config = json.loads((folder / "config.json").read_text())
    layout = _layout(architecture)
    tmp = folder / f".{DENSE_FILE}.{os.getpid()}.tmp"
    try:
        _write_weights(tmp, tensors, config, source_path, layout)
        os.replace(tmp, folder / DENSE_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    weight_map = {n: f for f in (FLOATS_FILE, DENSE_FILE) for n in _names_in(folder / f)}
    size = sum((folder / f).stat().st_size for f in (FLOATS_FILE, DENSE_FILE))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    tmp_index = folder / f".{INDEX_FILE}.{os.getpid()}.tmp"
    tmp_index.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp_index, folder / INDEX_FILE)
