"""CUDA graphs of the whole forward, for decode steps and for small mixed steps.

A step is padded up to a captured shape: decode graphs take B one-token sequences (padded to a
captured batch size); verify graphs, when the engine speculates k tokens, take B sequences of
up to 1 + k tokens each (a token to sample plus its drafts: padded to B (1 + k) tokens); mixed
graphs take any batch of up to T tokens (padded to a captured token count, with as many
sequence slots as tokens, up to max_num_seqs). Padding tokens belong to no
sequence and write nowhere; padding sequences have no queries and no context. Attention is
launched with host-side bounds (max_query_len, max_model_len), never with device values, so one
graph serves every step of its shape. Inputs live in the runner's persistent buffers; graphs are
captured largest first into one shared memory pool.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.logger import init_logger

if TYPE_CHECKING:
    from inferengine.worker.input_batch import InputBuffers

# The model's forward over the KV cache: (input ids, positions, metadata) -> hidden states.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

logger = init_logger(__name__)

# Mixed steps above this many tokens run eagerly: their GPU time dwarfs the launch overhead.
MAX_MIXED_GRAPH_TOKENS = 2048


def default_capture_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """Batch sizes for decode graphs: 1, 2, 4, 8, then every 8 up to max_num_seqs."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(set(sizes))


def default_mixed_sizes(max_num_tokens: int) -> list[int]:
    """Token counts for mixed graphs: every 64 up to 512, 128 up to 1024, 256 up to 2048."""
    sizes = list(range(64, 513, 64)) + list(range(640, 1025, 128)) + list(range(1280, 2049, 256))
    return [s for s in sizes if s <= min(max_num_tokens, MAX_MIXED_GRAPH_TOKENS)]


class GraphShape:
    """One captured shape: token slots, sequence slots and the attention bounds."""

    def __init__(self, kind: str, num_tokens: int, num_seqs: int, max_query_len: int):
        self.kind = kind
        self.num_tokens = num_tokens
        self.num_seqs = num_seqs
        self.max_query_len = max_query_len

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, self.num_seqs if self.kind == "verify" else self.num_tokens


class CudaGraphRunner:
    """With `capture=False` (`--enforce-eager`) steps take the same padded shapes and launch
    bounds but run eagerly, so graphs change nothing about the numbers."""

    def __init__(
        self,
        buffers: InputBuffers,
        max_model_len: int,
        forward: Forward,
        decode_sizes: list[int],
        mixed_sizes: list[int],
        capture: bool = True,
        verify_len: int = 1,
    ):
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.forward = forward
        self.use_graphs = capture
        max_seqs = buffers.max_num_seqs
        self.decode_sizes = sorted(decode_sizes)
        self.mixed_sizes = sorted(mixed_sizes)
        self.shapes = {("decode", b): GraphShape("decode", b, b, 1) for b in self.decode_sizes}
        for t in self.mixed_sizes:
            self.shapes[("mixed", t)] = GraphShape("mixed", t, min(t, max_seqs), t)
        # Verify steps: each sequence scores its next token and up to verify_len - 1 drafts.
        self.verify_len = verify_len
        max_tokens = min(buffers.max_num_tokens, MAX_MIXED_GRAPH_TOKENS)
        self.verify_sizes = (
            [b for b in self.decode_sizes if b * verify_len <= max_tokens] if verify_len > 1 else []
        )
        for b in self.verify_sizes:
            self.shapes[("verify", b)] = GraphShape("verify", b * verify_len, b, verify_len)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[str, int], torch.Tensor] = {}
        self._metadata: dict[tuple[str, int], AttentionMetadata] = {}

    def shape_for(self, num_tokens: int, num_seqs: int, max_query_len: int) -> GraphShape | None:
        """The smallest captured shape that holds this step, or None (run it eagerly)."""
        if max_query_len == 1:
            i = bisect.bisect_left(self.decode_sizes, num_seqs)
            if i < len(self.decode_sizes):
                return self.shapes[("decode", self.decode_sizes[i])]
        if max_query_len <= self.verify_len:
            i = bisect.bisect_left(self.verify_sizes, num_seqs)
            if i < len(self.verify_sizes):
                return self.shapes[("verify", self.verify_sizes[i])]
        i = bisect.bisect_left(self.mixed_sizes, num_tokens)
        if i < len(self.mixed_sizes):
            shape = self.shapes[("mixed", self.mixed_sizes[i])]
            if num_seqs <= shape.num_seqs:
                return shape
        return None

    def metadata(self, shape: GraphShape) -> AttentionMetadata:
        md = self._metadata.get(shape.key)
        if md is None:
            b = self.buffers
            md = AttentionMetadata(
                num_actual_tokens=shape.num_tokens,
                max_query_len=shape.max_query_len,
                max_seq_len=self.max_model_len,
                query_start_loc=b.query_start_loc[: shape.num_seqs + 1],
                seq_lens=b.seq_lens[: shape.num_seqs],
                block_table=b.block_table_dev[: shape.num_seqs],
                slot_mapping=b.slot_mapping[: shape.num_tokens],
            )
            self._metadata[shape.key] = md
        return md

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        b = self.buffers
        n = shape.num_tokens
        metadata = self.metadata(shape)
        metadata.per_step.clear()  # this metadata serves every step of its shape
        return self.forward(b.input_ids[:n], b.positions[:n], metadata)

    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        b = self.buffers
        # Dummy inputs: every token unowned and writing nowhere, every sequence empty.
        b.input_ids.zero_()
        b.positions.zero_()
        b.slot_mapping.fill_(-1)
        b.query_start_loc.zero_()
        b.seq_lens.zero_()
        b.block_table_dev.zero_()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        order = sorted(self.shapes.values(), key=lambda s: s.num_tokens, reverse=True)
        with torch.cuda.stream(stream):
            for shape in order:
                self._forward(shape)  # warm-up: compiles kernels for this shape
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[shape.key] = self._forward(shape)
                pool = graph.pool()
                self.graphs[shape.key] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (decode batch 1..%d, %smixed steps up to %d tokens) in %.2f s",
            len(self.graphs),
            max(self.decode_sizes, default=0),
            f"verify batch 1..{max(self.verify_sizes)} of {self.verify_len} tokens, "
            if self.verify_sizes
            else "",
            max(self.mixed_sizes, default=0),
            seconds,
        )
        return seconds

    def replay(self, shape: GraphShape) -> torch.Tensor:
        """Run the forward of `shape` (captured, or eagerly); returns hidden [tokens, hidden]."""
        if not self.use_graphs:
            return self._forward(shape)
        self.graphs[shape.key].replay()
        return self.hidden[shape.key]
