"""CUDA graphs for decode steps: the whole forward captured at padded batch sizes.

A decode step of B requests replays the graph of the smallest captured size ≥ B; the extra
sequences are one dummy token each that read the null block and write nowhere (slot −1).
Inputs live in the runner's persistent buffers, so a replay needs only the staging copies.
Graphs are captured largest first into one shared memory pool.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.logger import init_logger

if TYPE_CHECKING:
    from inferengine.worker.model_runner import ModelRunner

logger = init_logger(__name__)


def default_capture_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(set(sizes))


class CudaGraphRunner:
    """With `capture=False` (`--enforce-eager`) decode steps take the same padded shapes and
    launch bounds but run eagerly, so graphs change nothing about the numbers."""

    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool = True):
        self.runner = runner
        self.sizes = sorted(sizes)
        self.use_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._metadata: dict[int, AttentionMetadata] = {}

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def metadata(self, size: int) -> AttentionMetadata:
        md = self._metadata.get(size)
        if md is None:
            b = self.runner.buffers
            md = AttentionMetadata(
                num_actual_tokens=size,
                max_query_len=1,
                # An upper bound: the kernels size their launch by it, never by device values.
                max_seq_len=self.runner.max_model_len,
                query_start_loc=b.query_start_loc[: size + 1],
                seq_lens=b.seq_lens[:size],
                block_table=b.block_table_dev[:size],
                slot_mapping=b.slot_mapping[:size],
            )
            self._metadata[size] = md
        return md

    def _forward(self, size: int) -> torch.Tensor:
        b = self.runner.buffers
        return self.runner.model(
            b.input_ids[:size], b.positions[:size], self.runner.kv_caches, self.metadata(size)
        )

    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        b = self.runner.buffers
        # Dummy decode inputs: every sequence one token at position 0, writing nowhere.
        max_size = self.sizes[-1]
        b.input_ids[:max_size].zero_()
        b.positions[:max_size].zero_()
        b.slot_mapping[:max_size].fill_(-1)
        b.query_start_loc[: max_size + 1].copy_(torch.arange(max_size + 1, dtype=torch.int32))
        b.seq_lens[:max_size].fill_(1)
        b.block_table_dev[:max_size].zero_()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: compiles kernels for this shape
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (batch 1..%d) in %.2f s", len(self.sizes), max_size, seconds
        )
        return seconds

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured forward; returns its hidden states [size, hidden]."""
        if not self.use_graphs:
            return self._forward(size)
        self.graphs[size].replay()
        return self.hidden[size]
