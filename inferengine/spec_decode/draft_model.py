"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

It runs in the worker beside the target. Its KV pages share the target's page ids (one pool:
`kv_memory` sizes a page as the target's layers plus the draft's), so the scheduler's lookahead
slots serve both. Per request it remembers how many leading positions of its cache hold the
request's real tokens; each call first feeds what the draft has not seen (a prompt, the tokens
the target accepted and its new token), then k - 1 single-token passes feed its own drafts.
Positions it fed with drafts the target later rejected are fed again at the next call.

Drafts are greedy (argmax), so the rejection sampler treats them as one-hot proposals, which
keeps the target's distribution exact for sampled requests too. The target's hidden states are
accepted and unused: a draft model conditions on tokens only (EAGLE-3 / MTP heads will use them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.logger import init_logger

logger = init_logger(__name__)


@dataclass(slots=True)
class DraftRequest:
    """One request to draft for: all its tokens so far, its row of the block table, k."""

    req_id: str
    token_ids: np.ndarray  # int64, prompt and output so far
    block_ids: np.ndarray  # int32 page ids covering at least len(token_ids) + k - 1 positions
    num_drafts: int


@dataclass(slots=True)
class _DraftState:
    num_valid: int = 0  # leading positions whose draft K/V hold the request's real tokens
    fed_drafts: list[int] = field(default_factory=list)  # drafts fed after those positions


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self._states: dict[str, _DraftState] = {}

    def finish(self, req_id: str) -> None:
        """The request ended or was preempted: its pages may go to others."""
        self._states.pop(req_id, None)

    @torch.inference_mode()
    def propose(
        self, requests: list[DraftRequest], target_hidden: torch.Tensor | None = None
    ) -> list[list[int]]:
        """k greedy drafts for each request (k = its `num_drafts`)."""
        del target_hidden  # a draft model conditions on tokens only
        if not requests:
            return []
        starts, chunks = [], []
        for r in requests:
            state = self._states.setdefault(r.req_id, _DraftState())
            n = len(r.token_ids)
            seen = r.token_ids[state.num_valid : state.num_valid + len(state.fed_drafts)]
            matched = 0
            while matched < len(seen) and seen[matched] == state.fed_drafts[matched]:
                matched += 1
            # Feed at least the last token: its logits give the first draft.
            start = min(state.num_valid + matched, n - 1)
            starts.append(start)
            chunks.append(r.token_ids[start:])
            state.num_valid, state.fed_drafts = n, []
        drafts: list[list[int]] = [[] for _ in requests]
        next_tokens = self._forward(requests, starts, chunks)
        active = list(range(len(requests)))
        for step in range(max(r.num_drafts for r in requests)):
            for i, token in zip(active, next_tokens, strict=True):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < requests[i].num_drafts]
            if not active:
                break
            # Feed each active request its newest draft at the position after its last one.
            sub = [requests[i] for i in active]
            positions = [len(requests[i].token_ids) + step for i in active]
            tokens = [np.array([drafts[i][-1]]) for i in active]
            for i in active:
                self._states[requests[i].req_id].fed_drafts.append(drafts[i][-1])
            next_tokens = self._forward(sub, positions, tokens)
        return drafts

    def _forward(
        self, requests: list[DraftRequest], starts: list[int], chunks: list[np.ndarray]
    ) -> list[int]:
        """Run the draft on each request's `chunk` at positions `start...`; return the greedy
        token after each chunk's last position."""
        bs = self.block_size
        q_lens = np.array([len(c) for c in chunks], dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + q_lens
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        positions = np.concatenate(
            [np.arange(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)]
        )
        owner = np.repeat(np.arange(len(requests)), q_lens)
        width = int(-(-seq_lens.max() // bs))
        table = np.zeros((len(requests), width), dtype=np.int32)
        for i, r in enumerate(requests):
            n = min(width, len(r.block_ids))
            table[i, :n] = r.block_ids[:n]
        slots = table[owner, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(q_lens.max()),
            min_query_len=int(q_lens.min()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids = torch.from_numpy(np.concatenate(chunks).astype(np.int64)).to(dev)
        hidden = self.model(
            input_ids, torch.from_numpy(positions).to(dev), self.kv_caches, metadata
        )
        last = torch.from_numpy(qsl[1:] - 1).to(dev)
        logits = self.model.compute_logits(hidden[last])
        return logits.argmax(dim=-1).tolist()
