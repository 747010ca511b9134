"""`ModelRunner`: turns a `SchedulerOutput` into model inputs, runs the forward pass, samples.

It keeps each request's tokens and block ids between steps, so the scheduler sends only what
changed. It decides nothing about who runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.sample.metadata import build_sampling_metadata
from inferengine.sample.sampler import Sampler, gather_logprobs
from inferengine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    req_ids: list[str]
    sample_rows: list[int]  # batch rows that produce a token this step
    logits_indices: torch.Tensor  # flat token index of each sampling row's last token
    prompt_logprob_rows: dict[str, tuple[int, int, int]]  # req -> (flat start, count, first pos)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()

    # ---- state -------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids,
                sampling_params=params,
                eos_token_id=new.eos_token_id,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- inputs ------------------------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        block_rows: list[list[int]] = []
        sample_rows: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        req_ids = list(so.num_scheduled_tokens)
        bs = self.block_size
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            flat_start = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(input_ids))
            seq_lens.append(end)
            block_rows.append(blocks)
            if end >= len(state.token_ids):
                sample_rows.append(row)
                logits_indices.append(len(input_ids) - 1)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                count = min(end, num_prompt - 1) - start
                prompt_rows[req_id] = (flat_start, count, start)
        max_blocks = max(len(b) for b in block_rows)
        table = [b + [0] * (max_blocks - len(b)) for b in block_rows]
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=max(b - a for a, b in itertools.pairwise(query_start)),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            metadata=metadata,
            req_ids=req_ids,
            sample_rows=sample_rows,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            prompt_logprob_rows=prompt_rows,
        )

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self._prepare_inputs(so)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        sampled_lists: list[list[int]] = [[] for _ in inputs.req_ids]
        output = ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled_lists)
        if inputs.sample_rows:
            self._sample(inputs, hidden, output)
        if inputs.prompt_logprob_rows:
            self._prompt_logprobs(inputs, hidden, output)
        return output

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        states = [self.requests[inputs.req_ids[row]] for row in inputs.sample_rows]
        md = build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.generator for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            [s.eos_token_id for s in states],
            self.device,
        )
        result = self.sampler(logits, md)
        sampled = result.sampled.tolist()  # the one host sync of the step
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.sampled_ranks is not None
            ids, values, ranks = (
                result.logprob_token_ids.tolist(),
                result.logprobs.tolist(),
                result.sampled_ranks.tolist(),
            )
        for i, (row, state) in enumerate(zip(inputs.sample_rows, states, strict=True)):
            token = sampled[i]
            output.sampled_token_ids[row] = [token]
            state.output_token_ids.append(token)
            state.token_ids.append(token)
            num_top = state.sampling_params.logprobs
            if num_top is not None and result.logprobs is not None:
                output.logprobs[state.req_id] = (
                    [ids[i][: 1 + num_top]],
                    [values[i][: 1 + num_top]],
                    [ranks[i]],
                )

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        for req_id, (flat_start, count, first_pos) in inputs.prompt_logprob_rows.items():
            state = self.requests[req_id]
            num_top = state.sampling_params.prompt_logprobs or 0
            logits = self.model.compute_logits(hidden[flat_start : flat_start + count]).float()
            targets = torch.tensor(
                state.prompt_token_ids[first_pos + 1 : first_pos + 1 + count], device=self.device
            )
            ids, values, ranks = gather_logprobs(logits.log_softmax(-1), targets, num_top)
            output.prompt_logprobs[req_id] = (
                ids.tolist(),
                values.tolist(),
                ranks.tolist(),
                first_pos,
            )

    # ---- start-up ----------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can send, on throwaway pages: measures peak memory."""
        sc = self.config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        seq_len = min(num_tokens, sc.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        lens = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
        bs = self.block_size
        blocks_per_seq = -(-seq_len // bs)
        dtype = next(self.model.parameters()).dtype
        from inferengine.worker.kv_memory import allocate_kv_caches

        kv = allocate_kv_caches(self.config, num_seqs * blocks_per_seq + 1, dtype, self.device)
        table = [
            [1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(num_seqs)
        ]
        slots = [table[i][p // bs] * bs + p % bs for i, n in enumerate(lens) for p in range(n)]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dev = self.device
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
        input_ids = torch.randint(0, self.vocab_size, (num_tokens,), device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden = self.model(input_ids, positions, kv, metadata)
        rows = min(sc.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * rows
        md = build_sampling_metadata(
            params, [None] * rows, [[]] * rows, [[]] * rows, [None] * rows, dev
        )
        self.sampler(logits, md)
        del kv, hidden, logits
