"""The memory-profiling step: the largest step the scheduler can send, run once at start-up on
throwaway pages so that the KV cache is sized from the measured peak."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.distributed.parallel_state import get_pp_size, is_first_stage, is_last_stage
from inferengine.model.loader.loader import TORCH_DTYPES
from inferengine.sample.metadata import build_sampling_metadata
from inferengine.sampling_params import SamplingParams
from inferengine.worker.kv_memory import allocate_kv_caches, kv_cache_dtype

if TYPE_CHECKING:
    from inferengine.worker.model_runner import ModelRunner


@torch.inference_mode()
def profile_run(runner: ModelRunner) -> None:
    """The largest step the scheduler can send, on throwaway pages: measures peak memory."""
    sc = runner.config.scheduler_config
    num_tokens = sc.max_num_batched_tokens
    seq_len = min(num_tokens, sc.max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    lens = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
    bs = runner.block_size
    blocks_per_seq = -(-seq_len // bs)
    dtype = TORCH_DTYPES[runner.config.model_config.dtype]  # not a weight's: they may be FP8
    kv_dtype = kv_cache_dtype(runner.config)
    kv = allocate_kv_caches(runner.config, num_seqs * blocks_per_seq + 1, kv_dtype, runner.device)
    table = [[1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(num_seqs)]
    slots = [table[i][p // bs] * bs + p % bs for i, n in enumerate(lens) for p in range(n)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    dev = runner.device
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=seq_len,
        max_seq_len=seq_len,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_table=torch.tensor(table, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    input_ids = torch.randint(0, runner.vocab_size, (num_tokens,), device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    if get_pp_size() > 1:
        intermediate = None
        if not is_first_stage():
            h = torch.zeros(num_tokens, runner.hidden_size, dtype=dtype, device=dev)
            intermediate = (h, h.clone())
        hidden = runner.model(input_ids, positions, kv, metadata, intermediate)
        if not is_last_stage():
            return
    else:
        hidden = runner.model(input_ids, positions, kv, metadata)
    spec = runner.config.speculative_config
    rows = spec.max_logits_rows(sc.max_num_seqs) if spec is not None else sc.max_num_seqs
    rows = min(rows, num_tokens)
    logits = runner.model.compute_logits(hidden[:rows])
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * rows
    md = build_sampling_metadata(
        params, [None] * rows, [[]] * rows, [[]] * rows, [None] * rows, dev
    )
    runner.sampler(logits, md)
    del kv, hidden, logits
