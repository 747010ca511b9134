"""Pooling of final hidden states into one vector per prompt (last token, mean, CLS), and its
Matryoshka cut and normalization; the model runner folds prefill chunks through `pool_rows`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from inferengine.pooling_params import PoolingParams


def pool_rows(
    pooling_type: str, rows: torch.Tensor, start: int, partial: torch.Tensor | None
) -> torch.Tensor:
    """Fold one chunk's hidden rows (prompt positions `start`, `start + 1`, ...) into the
    request's pool so far: LAST keeps the chunk's last row, CLS position 0, MEAN the sum (the
    caller divides by the prompt length once the prompt is done)."""
    if pooling_type == "LAST":
        return rows[-1].float()
    if pooling_type == "CLS":
        return rows[0].float() if start == 0 else partial
    if pooling_type == "MEAN":
        total = rows.float().sum(dim=0)
        return total if partial is None else partial + total
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def postprocess(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Cut to `params.dimensions` (Matryoshka), then scale to unit length if asked; on the host."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector.cpu()
