"""The GGUF a converted folder keeps beside its float weights (`model.gguf`, a hard link where it
can be), with an index of its tensors (`model.gguf.json`: type, shape, byte offset), so loading
its quantized weights reads no GGUF metadata (a Gemma tokenizer's takes `gguf` seconds); which of
its tensors the quantized CPU path reads from its blocks (`block_only`)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_FILE = "model.gguf"
SOURCE_INDEX = "model.gguf.json"
# A lean conversion's float weights (model/loader/gguf_floats.py).
FLOATS_FILE = "model-floats.safetensors"
# The GGML block types our CPU kernels take (model/loader/gguf_quantized.py).
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
BLOCK_TYPES = (*Q4_TYPES, "Q8_0", "Q5_0")
# Roles whose weights our CPU kernels take from the GGUF's blocks (linear layers); each fused
# group (one layer of ours) stays quantized only when all its shards are of one block kind.
_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_output",), ("ffn_down",))


@dataclass(frozen=True)
class SourceTensor:
    name: str  # the GGUF's name, e.g. blk.0.attn_q.weight
    type: str  # GGML type name, e.g. Q4_1
    shape: tuple[int, ...]  # outermost first (rows, columns), as torch orders it
    offset: int  # of its data in the file
    nbytes: int


def keep_source(gguf_path: Path, tensors: Iterable[Any], architecture: str, folder: Path) -> None:
    """Link (else symlink) the GGUF into `folder` and write its tensor index (`tensors`: the
    reader's)."""
    try:
        os.link(gguf_path, folder / SOURCE_FILE)  # no copy; outlives a downloaded original
    except OSError:  # another file system: the cache key names the file's path, size and time
        (folder / SOURCE_FILE).symlink_to(gguf_path.resolve())
    index = {
        t.name: {
            "type": t.tensor_type.name,
            "shape": [int(n) for n in reversed(t.shape.tolist())],  # GGUF lists dims inner first
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }
        for t in tensors
    }
    text = json.dumps({"architecture": architecture, "tensors": index}, separators=(",", ":"))
    (folder / SOURCE_INDEX).write_text(text + "\n")


def has_source(folder: Path) -> bool:
    """The converted `folder` keeps its GGUF and index (converted since they were kept)."""
    return (folder / SOURCE_FILE).is_file() and (folder / SOURCE_INDEX).is_file()


class GGUFSource:
    """A converted folder's GGUF: its architecture, tensors by name, and their raw bytes."""

    def __init__(self, folder: Path):
        index = json.loads((folder / SOURCE_INDEX).read_text())
        self.path = folder / SOURCE_FILE
        self.architecture: str = index["architecture"]
        self.tensors = {
            name: SourceTensor(name, e["type"], tuple(e["shape"]), e["offset"], e["bytes"])
            for name, e in index["tensors"].items()
        }
        self._file: np.memmap | None = None

    def data(self, tensor: SourceTensor) -> np.ndarray:
        """Its bytes, uint8 [rows, bytes per row] (read from the mapped file when used)."""
        if self._file is None:
            self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._file[tensor.offset : tensor.offset + tensor.nbytes]
        return raw.reshape(tensor.shape[0], -1) if len(tensor.shape) == 2 else raw


def block_only(types: dict[str, str]) -> set[str]:
    """The GGUF tensors (of `types`: name -> GGML type name) that the quantized CPU path reads
    from the GGUF's blocks and never as floats."""

    def kind(name: str) -> str | None:
        qtype = types.get(name)
        if qtype not in BLOCK_TYPES:
            return None
        return "q4" if qtype in Q4_TYPES else "q8"

    out = {n for n in ("token_embd.weight", "output.weight") if kind(n)}  # head: untied
    layers: dict[str, list[str]] = defaultdict(list)
    for name in types:
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
            layers[parts[1]].append(parts[2])
    for layer in layers:
        for group in _GROUPS:
            names = [f"blk.{layer}.{role}.weight" for role in group]
            kinds = {kind(n) for n in names}
            if len(kinds) == 1 and None not in kinds:
                out.update(names)
    return out
