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

Several processes may load the folder at once (servers, tests, tensor-parallel ranks, an engine
core and its restart): each file is written under a temporary name and renamed into place, the
index last, and what to write is decided only under the folder's lock
(`checkpoint/cache_lock.py`), which conversions into the folder take too, so no conversion
replaces the folder under a writer. A writer killed halfway leaves at most a temporary file
(deleted by the next holder of the lock) or model-dense.safetensors without its index (indexed by
the next load that comes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from inferengine.checkpoint.cache_lock import folder_lock, remove_leftovers
from inferengine.checkpoint.gguf import _hf_name, _layout, _open, _write_weights
from inferengine.checkpoint.gguf_source import (
    FLOATS_FILE,  # noqa: F401 (named from here)
    SOURCE_FILE,
    GGUFSource,
    has_source,
)
from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger

logger = init_logger(__name__)

DENSE_FILE = "model-dense.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TEMP_FILES = (f".{DENSE_FILE}.*.tmp", f".{INDEX_FILE}.*.tmp")  # a writer's, renamed when done


def _names_in(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def ensure_float_weights(folder: Path, wanted: Callable[[str], bool] | None = None) -> None:
    """Before a load of converted GGUF `folder` that reads checkpoint names `wanted` accepts
    (None: all): write the float weights the folder left out if the load reads any of them.
    Safe while other processes load, convert or complete the same folder
    (`checkpoint/cache_lock.py`)."""
    if not has_source(folder) or (folder / INDEX_FILE).exists():
        return
    if not (folder / DENSE_FILE).exists():  # else a write stopped halfway: settled under the lock
        source = GGUFSource(folder)
        left_out = _left_out(folder, source)
        if not _reads_any(left_out, wanted):
            return  # the quantized path: nothing to write, no lock to wait for
    try:
        with folder_lock(folder):
            _complete(folder, wanted)
    except OSError as e:
        raise ModelLoadError(
            f"{folder} keeps float weights only for the CPU's quantized path, and writing the "
            f"others this load reads failed ({e}); make the folder writable, or convert the "
            ".gguf again."
        ) from e


def _reads_any(left_out: dict[str, str], wanted: Callable[[str], bool] | None) -> bool:
    return any(wanted is None or wanted(hf) for hf in left_out.values())


def _left_out(folder: Path, source: GGUFSource) -> dict[str, str]:
    """The GGUF tensors (name -> checkpoint name) whose floats no file in `folder` but
    model-dense.safetensors holds."""
    roles = _layout(source.architecture).layer_tensors
    present = {n for path in _kept_files(folder) for n in _names_in(path)}
    return {
        name: hf
        for name in source.tensors
        if (hf := _hf_name(name, roles)) is not None and hf not in present
    }


def _kept_files(folder: Path) -> list[Path]:
    """The float files of the conversion itself (model-floats.safetensors, or model.safetensors
    in a folder converted whole)."""
    return [p for p in sorted(folder.glob("*.safetensors")) if p.name != DENSE_FILE]


def _complete(folder: Path, wanted: Callable[[str], bool] | None) -> None:
    """`ensure_float_weights`, holding the folder's lock: decided on the folder as it is now."""
    if (folder / INDEX_FILE).exists():
        return  # another process completed it meanwhile
    remove_leftovers(folder, _TEMP_FILES)
    source = GGUFSource(folder)
    left_out = _left_out(folder, source)
    dense = folder / DENSE_FILE
    if dense.exists() and set(_names_in(dense)) == set(left_out.values()):
        _write_index(folder, [*_kept_files(folder), dense])  # its writer stopped before this
    elif left_out and (dense.exists() or _reads_any(left_out, wanted)):
        _write_dense(folder, set(left_out), source.architecture)  # replacing any stray one
    elif dense.exists():
        # Tensors the folder keeps already (a folder converted whole, completed by an earlier
        # version): the index first, so no load from now on reads them twice or lists the file.
        _write_index(folder, _kept_files(folder))
        dense.unlink()


def _write_dense(folder: Path, names: set[str], architecture: str) -> None:
    """`names` (GGUF names) dequantized to `model-dense.safetensors`, then the index."""
    source_path = folder / SOURCE_FILE
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
    _write_index(folder, [*_kept_files(folder), folder / DENSE_FILE])


def _write_index(folder: Path, files: list[Path]) -> None:
    """model.safetensors.index.json over `files`: from then on loads read those files only."""
    weight_map = {n: path.name for path in files for n in _names_in(path)}
    size = sum(path.stat().st_size for path in files)
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    tmp = folder / f".{INDEX_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, folder / INDEX_FILE)
    finally:
        tmp.unlink(missing_ok=True)
