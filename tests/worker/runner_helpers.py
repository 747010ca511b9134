"""A ModelRunner over a fake model on the CPU: the model records exactly what each forward got
(token ids, positions, slots, query starts, sequence lengths, block table) and its logits make
the next token of every position `(token + 1) % VOCAB`, by a wide margin."""

from __future__ import annotations

import torch

from inferengine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from inferengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from inferengine.sample.sampler import Sampler
from inferengine.sampling_params import SamplingParams
from inferengine.worker.model_runner import ModelRunner

VOCAB = 32
BS = 8
GREEDY = SamplingParams(temperature=0.0)


def engine_config(
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 32,
    num_speculative_tokens: int = 0,
) -> EngineConfig:
    hf = dict(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["FakeForCausalLM"],
    )
    spec = None
    if num_speculative_tokens:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens)
    return EngineConfig(
        model_config=ModelConfig(
            model="fake", model_path="", hf_config=hf, dtype="float32", max_model_len=max_model_len
        ),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        speculative_config=spec,
    )


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, input_ids, positions, kv_caches, metadata, intermediate=None):
        md = metadata
        self.calls.append(
            dict(
                ids=input_ids.tolist(),
                positions=positions.tolist(),
                slots=md.slot_mapping.tolist(),
                qsl=md.query_start_loc.tolist(),
                seq_lens=md.seq_lens.tolist(),
                table=md.block_table.tolist(),
                num_actual_tokens=md.num_actual_tokens,
                max_query_len=md.max_query_len,
                max_seq_len=md.max_seq_len,
            )
        )
        return input_ids.float().unsqueeze(1)  # hidden: the token id itself

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        nxt = (hidden[:, 0].long() + 1) % VOCAB
        logits = torch.full((len(hidden), VOCAB), -10.0)
        logits[torch.arange(len(hidden)), nxt] = 10.0
        return logits


class RecordingSampler(Sampler):
    """The runner's sampler, keeping the SamplingMetadata of every call and the output tokens
    it held then (its lists are the requests' own, which grow after the call)."""

    def __init__(self):
        self.seen = []
        self.outputs_seen: list[list[list[int]]] = []

    def __call__(self, logits, md):
        self.seen.append(md)
        self.outputs_seen.append([list(tokens) for tokens in md.output_token_ids])
        return super().__call__(logits, md)


def make_runner(**kwargs) -> tuple[ModelRunner, FakeModel]:
    model = FakeModel()
    runner = ModelRunner(engine_config(**kwargs), model, torch.device("cpu"))
    runner.sampler = RecordingSampler()
    return runner, model


def new(req_id, prompt, blocks, params=GREEDY, computed=0, output=(), eos=None):
    return NewRequestData(req_id, list(prompt), list(output), params, eos, list(blocks), computed)


def cached(req_id, computed, new_blocks=()):
    return CachedRequestData(req_id, list(new_blocks), computed)


def step(scheduled: dict[str, int], new_reqs=(), cached_reqs=(), finished=(), drafts=None):
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=list(cached_reqs),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
        scheduled_spec_decode_tokens=dict(drafts or {}),
    )
