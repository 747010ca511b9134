"""A plain paged-cache loop over a model, without the scheduler: for model-level tests."""

from __future__ import annotations

import torch

from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.attention.metadata import AttentionMetadata
from inferengine.checkpoint.resolve import resolve_model
from inferengine.config import ModelConfig
from inferengine.model.loader.loader import load_model


def load_tiny(path, dtype: str = "float32"):
    resolved = resolve_model(str(path))
    config = ModelConfig(
        model=str(path),
        model_path=str(resolved.path),
        hf_config=resolved.hf_config,
        dtype=dtype,
        max_model_len=1024,
    )
    return load_model(config, torch.device("cpu"), TorchAttentionBackend()), config


class PagedLoop:
    """Each sequence owns consecutive pages; every call runs the given new tokens of each."""

    def __init__(self, model, config: ModelConfig, num_seqs: int, block_size: int = 16):
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-config.max_model_len // block_size)
        num_blocks = 1 + num_seqs * self.blocks_per_seq
        dtype = next(model.parameters()).dtype
        self.kv = [
            torch.zeros(
                2, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype=dtype
            )
            for _ in range(config.num_layers)
        ]
        # Pages in a scrambled order, so block tables are not the identity.
        ids = torch.randperm(num_blocks - 1) + 1
        self.table = ids.view(num_seqs, self.blocks_per_seq).to(torch.int32)
        self.lengths = [0] * num_seqs

    @torch.no_grad()
    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Run each sequence's new tokens; return each one's logits [len(new), vocab]."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        bs = self.block_size
        for seq, tokens in enumerate(new_tokens):
            start = self.lengths[seq]
            for i, token in enumerate(tokens):
                p = start + i
                ids.append(token)
                positions.append(p)
                slots.append(int(self.table[seq, p // bs]) * bs + p % bs)
            self.lengths[seq] += len(tokens)
            starts.append(len(ids))
            seq_lens.append(self.lengths[seq])
        md = AttentionMetadata(
            num_actual_tokens=len(ids),
            max_query_len=max(len(t) for t in new_tokens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=self.table,
            slot_mapping=torch.tensor(slots),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv, md)
        logits = self.model.compute_logits(hidden).float()
        return [logits[starts[i] : starts[i + 1]] for i in range(len(new_tokens))]
