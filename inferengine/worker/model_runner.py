"""`ModelRunner`: turns a `SchedulerOutput` into model inputs, runs the forward pass, samples.

It keeps each request's tokens and block ids in persistent rows between steps, so the scheduler
sends only what changed, and builds each step's inputs with numpy into pinned buffers copied to
the device asynchronously. Decode-only steps replay CUDA graphs. It decides nothing about who
runs.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from inferengine.attention.metadata import AttentionMetadata
from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.distributed.parallel_state import (
    get_pp_size,
    is_first_stage,
    is_last_stage,
    pp_recv,
    pp_send,
)
from inferengine.model.loader.loader import TORCH_DTYPES
from inferengine.sample.metadata import build_sampling_metadata
from inferengine.sample.rejection_sampler import NO_TOKEN, rejection_sample
from inferengine.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from inferengine.spec_decode.base import may_speculate
from inferengine.spec_decode.draft_model import DraftModelProposer, DraftRequest
from inferengine.worker.cuda_graphs import CudaGraphRunner, GraphShape
from inferengine.worker.grammar_mask import apply_grammar_bitmask
from inferengine.worker.input_batch import InputBuffers, RequestState, StepLayout, append_tokens
from inferengine.worker.kv_connector import KVConnectorWorker
from inferengine.worker.kv_offload import HostKVTier
from inferengine.worker.pending_step import DeferredSampling, PendingStep, SpecResult
from inferengine.worker.pooling import PoolingRunner


def _plain_greedy(state: RequestState) -> bool:
    """Greedy, and nothing changes its logits or asks for logprobs: argmax alone decides."""
    p = state.sampling_params
    return p.greedy and not p.logit_bias and may_speculate(p, len(state.output_token_ids))


@dataclass
class StepInputs:
    num_tokens: int  # real tokens (padding excluded)
    metadata: AttentionMetadata
    req_ids: list[str]
    sample_rows: list[int]  # batch rows that produce a token this step
    logits_rows: list[int]  # flat token index of each sampling position (1 + drafts per row)
    drafts: list[list[int]]  # per sampling row: the draft tokens it verifies
    prompt_logprob_rows: dict[str, tuple[int, int, int]]  # req -> (flat start, count, first pos)
    graph_shape: GraphShape | None  # the padded shape to run as a CUDA graph, if any
    num_scheduled: list[int]  # tokens per request, in batch order


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        self.config = config
        self.model = model
        self.device = device
        sc = config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.hidden_size = config.model_config.hf_config["hidden_size"]
        self.max_model_len = sc.max_model_len
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        spec = config.speculative_config
        self.max_drafts = spec.num_speculative_tokens if spec is not None else 0
        self.buffers = InputBuffers(
            sc.max_num_seqs,
            max(sc.max_num_batched_tokens, sc.max_num_seqs),
            sc.max_model_len,
            self.block_size,
            device,
            max_logits_rows=spec.max_logits_rows(sc.max_num_seqs) if spec else sc.max_num_seqs,
        )
        self.graphs: CudaGraphRunner | None = None
        self._last: PendingStep | None = None  # the last launched step
        # Launched steps whose tokens are not yet in the request state, oldest first, each with
        # its sampling rows' states: added once resolved (`_apply_resolved`).
        self._unapplied: deque[tuple[PendingStep, list[RequestState]]] = deque()
        self._last_index: dict[str, int] = {}  # request -> its row in that step's samples
        # Hidden states at the last step's sampling positions, for model proposers.
        self._last_hidden: torch.Tensor | None = None
        self.pooling = PoolingRunner(model)  # embeddings and scores of prompt-only requests
        self.drafter: DraftModelProposer | None = None  # set by the worker for draft_model
        self.host_tier: HostKVTier | None = None  # the CPU tier, set by the worker
        self.kv_connector: KVConnectorWorker | None = None  # disaggregated prefill/decode
        self.lora = None  # Multi-LoRA: worker/lora_slots.LoRASlots, set by the worker

    # ---- state -------------------------------------------------------------------------

    def _apply_resolved(self) -> None:
        """Add the tokens of the steps resolved since the last call to their requests' state
        (a request that finished meanwhile keeps no state)."""
        kept: deque[tuple[PendingStep, list[RequestState]]] = deque()
        while self._unapplied:
            pending, states = self._unapplied.popleft()
            if not pending.resolved:
                kept.append((pending, states))
                continue
            tokens = pending.output.sampled_token_ids
            for row, state in zip(pending.sample_rows, states, strict=True):
                if state.row >= 0:
                    append_tokens(self.buffers.token_ids, state, tokens[row])
        self._unapplied = kept

    def _update_states(self, so: SchedulerOutput) -> None:
        buffers = self.buffers
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.finish(req_id)
            if state is not None:
                buffers.free_row(state.row)
                state.row = -1  # a pending step may still hold it
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                # Resumed after a preemption: skip the draws its earlier tokens used, so the
                # same seed gives the same text with or without preemption.
                for _ in new.output_token_ids:
                    torch.empty(self.vocab_size, device=self.device).exponential_(
                        generator=generator
                    )
            tokens = new.prompt_token_ids + new.output_token_ids
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                row=buffers.add_row(tokens, new.block_ids),
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                num_tokens=len(tokens),
                sampling_params=params,
                eos_token_id=new.eos_token_id,
                num_blocks=len(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            self._append_blocks(state, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids and not is_last_stage():  # the last stage sampled them
                append_tokens(self.buffers.token_ids, state, cached.new_token_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # The drafts end the request's scheduled tokens; a step scheduled while the one
            # before it samples this request's next token starts at that token.
            state = self.requests[req_id]
            start = state.num_computed_tokens + so.num_scheduled_tokens[req_id] - len(drafts)
            buffers.token_ids[state.row, start : start + len(drafts)] = drafts

    def _append_blocks(self, state: RequestState, block_ids: list[int]) -> None:
        if block_ids:
            n = len(block_ids)
            self.buffers.block_table[state.row, state.num_blocks : state.num_blocks + n] = block_ids
            state.num_blocks += n

    # ---- inputs ------------------------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        layout = StepLayout(
            rows=np.fromiter((s.row for s in states), dtype=np.int64, count=len(states)),
            starts=np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states)),
            num_scheduled=np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(states)),
        )
        sample_rows: list[int] = []
        logits_rows: list[int] = []
        row_drafts: list[list[int]] = []
        drafts = so.scheduled_spec_decode_tokens
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        flat = 0
        for row, (state, n) in enumerate(zip(states, layout.num_scheduled.tolist(), strict=True)):
            start = state.num_computed_tokens
            end = start + n
            if end >= state.num_tokens:
                verified = drafts.get(state.req_id, [])
                d = len(verified)
                sample_rows.append(row)
                logits_rows.extend(range(flat + n - 1 - d, flat + n))
                row_drafts.append(verified)
            num_prompt = len(state.prompt_token_ids)
            wants_prompt_lp = state.sampling_params.prompt_logprobs is not None
            if wants_prompt_lp and not state.output_token_ids and start < num_prompt - 1:
                prompt_rows[state.req_id] = (flat, min(end, num_prompt - 1) - start, start)
            flat += n
        num_tokens = flat
        max_query_len = int(layout.num_scheduled.max())
        b = len(states)
        shape = None
        if self.graphs is not None:
            shape = self.graphs.shape_for(num_tokens, b, max_query_len)
        if shape is not None:
            self.buffers.stage(
                layout, pad_tokens=shape.num_tokens - num_tokens, pad_seqs=shape.num_seqs - b
            )
            metadata = self.graphs.metadata(shape)
        else:
            self.buffers.stage(layout)
            seq_lens_np = layout.starts + layout.num_scheduled
            max_seq_len = int(seq_lens_np.max())
            num_blocks = -(-max_seq_len // self.block_size)
            metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                min_query_len=int(layout.num_scheduled.min()),
                max_seq_len=max_seq_len,
                query_start_loc=self.buffers.query_start_loc[: b + 1],
                seq_lens=self.buffers.seq_lens[:b],
                block_table=self.buffers.block_table_dev[:b, :num_blocks],
                slot_mapping=self.buffers.slot_mapping[:num_tokens],
                query_start_loc_cpu=self.buffers.st.qsl[: b + 1].tolist(),
                seq_lens_cpu=seq_lens_np.tolist(),
            )
        return StepInputs(
            num_tokens=num_tokens,
            metadata=metadata,
            req_ids=req_ids,
            sample_rows=sample_rows,
            logits_rows=logits_rows,
            drafts=row_drafts,
            prompt_logprob_rows=prompt_rows,
            graph_shape=shape,
            num_scheduled=layout.num_scheduled.tolist(),
        )

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        output = self.execute_model_async(so).resolve()
        self._apply_resolved()
        return output

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> PendingStep | DeferredSampling:
        """Launch one step; its sampled tokens reach the host when the result is resolved.

        A decode whose previous token is still on its way takes it straight from the device.
        With `so.grammar_deferred`, sampling waits for the grammar masks (`provide_grammar`).
        """
        self._apply_resolved()
        self._update_states(so)
        self.pooling.update(so)
        if self.host_tier is not None:
            self.host_tier.copy(self.kv_caches, so.kv_offloads, so.kv_loads, so.kv_writebacks)
        if so.is_empty:
            return PendingStep(self._kv_transfer(ModelRunnerOutput([], []), so), [], [], None)
        self._resolve_if_history_needed(so)
        inputs = self._prepare_inputs(so)
        if self.lora is not None:  # each token's adapter slot
            self.lora.prepare(so, inputs.req_ids, inputs.num_scheduled, inputs.graph_shape)
        self._fill_pending_tokens(inputs)
        output = ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids]
        )
        states = [self.requests[inputs.req_ids[row]] for row in inputs.sample_rows]
        hidden = self._forward(inputs)
        self._kv_transfer(output, so)
        if hidden is None:  # an earlier pipeline stage: the last one samples
            self._last, self._last_index = None, {}
            return PendingStep(output, [], [], None)
        output.pooled = self.pooling.pool(inputs, self.requests, hidden)
        logits = None
        if inputs.sample_rows:
            rows = self.buffers.stage_logits_indices(inputs.logits_rows)
            sampled_hidden = hidden[rows]
            if self.drafter is not None:
                self._last_hidden = sampled_hidden
            logits = self.model.compute_logits(sampled_hidden)
        if inputs.prompt_logprob_rows:
            self._prompt_logprobs(inputs, hidden, output)
        sample = functools.partial(self._sample, inputs, states, output, logits)
        if so.grammar_deferred and logits is not None:
            graph_size = inputs.graph_shape.num_tokens if inputs.graph_shape else None
            return DeferredSampling(sample, graph_size)
        return sample(so.grammar_req_ids, so.grammar_bitmask)

    def _kv_transfer(self, output: ModelRunnerOutput, so: SchedulerOutput) -> ModelRunnerOutput:
        """Disaggregated prefill/decode: this step's fetches and publishes, and what ended."""
        if self.kv_connector is not None:
            output.kv_events = self.kv_connector.step(so)
        return output

    @torch.inference_mode()
    def _sample(
        self,
        inputs: StepInputs,
        states: list[RequestState],
        output: ModelRunnerOutput,
        logits: torch.Tensor | None,
        grammar_req_ids: list[str],
        grammar_bitmask: bytes,
    ) -> PendingStep:
        """Sample the step's logits (masked by the grammars of `grammar_req_ids`)."""
        self._apply_resolved()  # penalties and min_tokens read the tokens so far
        result = spec = None
        if logits is not None:
            if grammar_req_ids:
                apply_grammar_bitmask(
                    logits,
                    grammar_req_ids,
                    grammar_bitmask,
                    [s.req_id for s in states],
                    [len(d) for d in inputs.drafts],
                )
            if any(inputs.drafts):
                result, spec = self._verify_drafts(logits, states, inputs.drafts)
            else:
                result = self.sampler(logits, self._metadata(states))
        num_logprobs = [s.sampling_params.logprobs for s in states]
        pending = PendingStep(output, inputs.sample_rows, num_logprobs, result, spec)
        pending.graph_size = inputs.graph_shape.num_tokens if inputs.graph_shape else None
        self._unapplied.append((pending, states))
        self._last = pending
        self._last_index = {s.req_id: i for i, s in enumerate(states)}
        return pending

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states of the step's tokens, or None on a pipeline stage before the last
        (which passes its activations on)."""
        n = inputs.num_tokens
        if inputs.graph_shape is not None:
            assert self.graphs is not None
            return self.graphs.replay(inputs.graph_shape)
        ids, positions = self.buffers.input_ids[:n], self.buffers.positions[:n]
        if get_pp_size() == 1:
            return self.model(ids, positions, self.kv_caches, inputs.metadata)
        intermediate = None
        if not is_first_stage():
            dtype = TORCH_DTYPES[self.config.model_config.dtype]  # not a weight's: FP8
            intermediate = tuple(pp_recv([(n, self.hidden_size)] * 2, dtype, self.device))
        out = self.model(ids, positions, self.kv_caches, inputs.metadata, intermediate)
        if is_last_stage():
            return out
        pp_send(list(out))
        return None

    def _metadata(self, states: list[RequestState], repeats: list[int] | None = None):
        """Sampling settings of `states`, each repeated `repeats[i]` times (draft positions)."""
        if repeats is not None:
            states = [s for s, r in zip(states, repeats, strict=True) for _ in range(r)]
        return build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.generator for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            [s.eos_token_id for s in states],
            self.device,
        )

    def _verify_drafts(
        self, logits: torch.Tensor, states: list[RequestState], drafts: list[list[int]]
    ) -> tuple[SamplerOutput | None, SpecResult]:
        """Rows without drafts sample as usual; rows with drafts go through rejection sampling
        (the engine core drafts only for requests whose sampling does not depend on earlier
        draws or tokens: no seeds, penalties, pending min_tokens or logprobs)."""
        if all(_plain_greedy(s) for s in states):
            # All-greedy: the argmax of each logits row goes to the host, where the drafts are
            # checked against it (one kernel, no probabilities).
            return None, SpecResult(logits.argmax(dim=-1), None, [], greedy_drafts=drafts)
        num_drafts = [len(d) for d in drafts]
        starts = np.cumsum([0, *(1 + d for d in num_drafts)])
        plain = [i for i, d in enumerate(num_drafts) if d == 0]
        drafted = [i for i, d in enumerate(num_drafts) if d > 0]
        dev = self.device
        result = None
        if plain:
            plain_rows = torch.tensor([int(starts[i]) for i in plain], device=dev)
            result = self.sampler(logits[plain_rows], self._metadata([states[i] for i in plain]))
        k = max(num_drafts)
        counts = [num_drafts[i] for i in drafted]
        flat_rows = [r for i in drafted for r in range(int(starts[i]), int(starts[i + 1]))]
        probs, greedy_rows = self.sampler.target_probs(
            logits[torch.tensor(flat_rows, device=dev)],
            self._metadata([states[i] for i in drafted], [1 + c for c in counts]),
        )
        # Row i of `probs` goes to (request j, position p) of the padded [J, K + 1, V] batch.
        slots = [j * (k + 1) + pos for j, c in enumerate(counts) for pos in range(c + 1)]
        padded = torch.zeros(len(drafted) * (k + 1), probs.shape[1], device=dev)
        padded[torch.tensor(slots, device=dev)] = probs
        draft_ids = np.zeros((len(drafted), k), dtype=np.int64)
        for j, (i, c) in enumerate(zip(drafted, counts, strict=True)):
            draft_ids[j, :c] = drafts[i]
        first_rows = [int(x) for x in np.cumsum([0, *(1 + c for c in counts[:-1])])]
        verified = rejection_sample(
            torch.from_numpy(draft_ids).to(dev),
            torch.tensor(counts, device=dev),
            padded.view(len(drafted), k + 1, -1),
            None,
            greedy_rows[torch.tensor(first_rows, device=dev)],
        )
        tokens = torch.full((len(states), k + 1), NO_TOKEN, dtype=torch.int64, device=dev)
        num_emitted = torch.ones(len(states), dtype=torch.int64, device=dev)
        if plain:
            tokens[plain, 0] = result.sampled
        tokens[drafted] = verified.token_ids
        num_emitted[drafted] = verified.num_accepted + 1
        return result, SpecResult(tokens, num_emitted, plain)

    @torch.inference_mode()
    def propose_drafts(self, wanted: dict[str, tuple[int, list[int]]]) -> dict[str, list[int]]:
        """Drafts from the draft model: `wanted` maps a request to (k, page ids the scheduler
        added for its lookahead). Runs after the last step resolved."""
        assert self.drafter is not None, "no draft model: the method drafts in the engine core"
        if self._last is not None:
            self._last.resolve()
        self._apply_resolved()
        requests = []
        for req_id, (k, new_block_ids) in wanted.items():
            state = self.requests[req_id]
            self._append_blocks(state, new_block_ids)
            requests.append(
                DraftRequest(
                    req_id,
                    self.buffers.token_ids[state.row, : state.num_tokens].astype(np.int64),
                    self.buffers.block_table[state.row, : state.num_blocks],
                    k,
                )
            )
        drafts = self.drafter.propose(requests, self._last_hidden)
        return dict(zip(wanted, drafts, strict=True))

    def _resolve_if_history_needed(self, so: SchedulerOutput) -> None:
        """Penalties and min_tokens need every earlier token on the host: wait for them."""
        if self._last is None or self._last.resolved:
            return
        for req_id in so.num_scheduled_tokens:
            state = self.requests[req_id]
            p = state.sampling_params
            if req_id in self._last_index and (
                p.uses_penalties or p.min_tokens > len(state.output_token_ids)
            ):
                self._last.resolve()
                self._apply_resolved()
                return

    def _fill_pending_tokens(self, inputs: StepInputs) -> None:
        dst, src = [], []
        flat = 0
        for req_id, n in zip(inputs.req_ids, inputs.num_scheduled, strict=True):
            state = self.requests[req_id]
            if state.num_computed_tokens >= state.num_tokens:
                assert self._last is not None and req_id in self._last_index, (
                    f"the token at position {state.num_tokens} of {req_id} is unknown"
                )
                dst.append(flat)
                src.append(self._last_index[req_id])
            flat += n
        if dst:
            assert self._last is not None and self._last.sampled_device is not None
            self.buffers.fill_from_device(dst, src, self._last.sampled_device)

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

    def capture_cuda_graphs(
        self, decode_sizes: list[int], mixed_sizes: list[int], capture: bool = True
    ) -> float:
        """Pad steps to captured shapes and capture a graph for each (unless `capture` is
        False); returns the seconds it took."""
        self.graphs = CudaGraphRunner(
            self.buffers,
            self.max_model_len,
            lambda ids, positions, md: self.model(ids, positions, self.kv_caches, md),
            decode_sizes,
            mixed_sizes,
            capture,
            verify_len=1 + self.max_drafts,
        )
        return self.graphs.capture() if capture else 0.0
