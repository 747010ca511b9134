"""Start-up warm-up: the steps CUDA-graph capture leaves cold run once, on the null KV page.

Graph capture runs every decode, verify and mixed shape up to `MAX_MIXED_GRAPH_TOKENS`; what
stays cold until the first request needs it is the eager path: prefill chunks above the largest
mixed graph (Triton kernels compile per constexpr and integer specialisation, the caching
allocator grows to the largest activations, cuBLAS picks its large-M kernels), chunks over a
long context, eager steps mixing decodes with a chunk, and the sampler's other paths (top-p/k,
min-p, seeded draws, penalties, logit bias, logprobs, prompt logprobs, a grammar mask). The
worker runs one synthetic step of each through the real runner before the engine reports
ready. Every synthetic page is the null page (block 0), which no request's KV lives in; its
contents and the RNG states are put back afterwards, so later requests see exactly the state a
cold start would give them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from inferengine.core.sched_output import NewRequestData, SchedulerOutput
from inferengine.distributed.parallel_state import get_pp_size
from inferengine.logger import init_logger
from inferengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inferengine.worker.model_runner import ModelRunner

logger = init_logger(__name__)

NULL_BLOCK = 0
MIXED_DECODES = 8  # decodes beside the chunk of the mixed eager step
SAMPLER_PROMPT = 8  # prompt tokens per request of a sampler step
GREEDY = SamplingParams(temperature=0.0)
SAMPLER_VARIANTS: dict[str, SamplingParams] = {
    "greedy": GREEDY,
    "top-p/top-k/min-p": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05),
    "seeded": SamplingParams(temperature=1.0, seed=0),
    "penalties": SamplingParams(
        temperature=1.0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={0: 1.0},
        min_tokens=2,
    ),
    "logprobs": SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5),
}


@dataclass(frozen=True)
class WarmRequest:
    context: int  # tokens taken as computed before this step (read from the null page)
    tokens: int  # tokens this step computes
    params: SamplingParams = field(default_factory=lambda: GREEDY)


@dataclass(frozen=True)
class WarmStep:
    label: str
    requests: tuple[WarmRequest, ...]
    grammar: bool = False  # every sampling row under an all-allowing grammar mask


def prefill_buckets(budget: int, graph_max: int) -> list[int]:
    """Step sizes that run eagerly: doubling from twice the largest mixed graph (0: none, so
    only the budget) below the budget, then the budget itself."""
    if budget <= graph_max:
        return []
    sizes = []
    t = 2 * graph_max
    while 0 < t < budget:
        sizes.append(t)
        t *= 2
    return [*sizes, budget]


def _chunks(total: int, cap: int, context: int = 0) -> tuple[WarmRequest, ...]:
    """`total` tokens as requests of at most `cap` tokens each (a request's whole length)."""
    sizes = [cap - context] * (total // (cap - context))
    if total % (cap - context):
        sizes.append(total % (cap - context))
    return tuple(WarmRequest(context, n) for n in sizes)


def warmup_plan(
    budget: int, max_model_len: int, max_num_seqs: int, graph_max: int
) -> list[WarmStep]:
    """The synthetic steps for a step budget of `budget` tokens, sequences of `max_model_len`,
    `max_num_seqs` rows and mixed graphs up to `graph_max` tokens (0: no graphs)."""
    budget = min(budget, max_model_len * max_num_seqs)
    steps = [WarmStep(f"prefill {t}", _chunks(t, max_model_len)) for t in prefill_buckets(
        budget, graph_max
    )]  # fmt: skip
    if steps and budget > 2 and max_num_seqs > 1:
        # Two sequences and a size that is not a multiple of 16 (Triton specialises on both).
        first = max(1, min((budget - 1) // 2, max_model_len))
        rest = _chunks(budget - 1 - first, max_model_len)
        steps.append(WarmStep(f"prefill {budget - 1} in 2+", (WarmRequest(0, first), *rest)))
    chunk = min(budget, max_model_len // 2)
    if max_model_len - chunk > 0 and chunk > graph_max:
        context = max_model_len - chunk
        steps.append(WarmStep(f"chunk {chunk} after {context}", (WarmRequest(context, chunk),)))
    decodes = min(MIXED_DECODES, max_num_seqs - 1, budget - 1)
    if budget > graph_max and decodes > 0:
        chunk_tokens = _chunks(budget - decodes, max_model_len)[: max_num_seqs - decodes]
        long_decodes = (WarmRequest(max_model_len - 1, 1),) * decodes
        label = f"mixed {decodes} decodes + {sum(r.tokens for r in chunk_tokens)}"
        steps.append(WarmStep(label, (*long_decodes, *chunk_tokens)))
    pair = min(2, max_num_seqs)
    prompt = min(SAMPLER_PROMPT, max_model_len - 1, budget // pair)
    for name, params in SAMPLER_VARIANTS.items():
        steps.append(WarmStep(f"sampler {name}", (WarmRequest(0, prompt, params),) * pair))
    steps.append(WarmStep("grammar mask", (WarmRequest(0, prompt),) * pair, grammar=True))
    return steps


def graph_max_tokens(runner: ModelRunner) -> int:
    """The largest mixed step the runner replays as a graph (0: no graphs or padded shapes)."""
    graphs = runner.graphs
    return max(graphs.mixed_sizes, default=0) if graphs is not None and graphs.use_graphs else 0


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> list[str]:
    """Run the plan through `runner` on the null page; returns the steps' labels."""
    if get_pp_size() > 1:
        logger.info("warm-up: skipped (pipeline stages step in lockstep with each other)")
        return []
    sc = runner.config.scheduler_config
    plan = warmup_plan(
        sc.max_num_batched_tokens, sc.max_model_len, sc.max_num_seqs, graph_max_tokens(runner)
    )
    start = time.perf_counter()
    saved_pages = [cache[:, NULL_BLOCK].clone() for cache in runner.kv_caches]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(runner.device) if runner.device.type == "cuda" else None
    rng = np.random.default_rng(0)
    finished: set[str] = set()
    for i, step in enumerate(plan):
        so = synthetic_step(runner, step, i, rng)
        so.finished_req_ids = finished
        runner.execute_model(so)
        finished = set(so.num_scheduled_tokens)
    runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=finished))
    runner._last, runner._last_index, runner._last_hidden = None, {}, None
    for cache, page in zip(runner.kv_caches, saved_pages, strict=True):
        cache[:, NULL_BLOCK].copy_(page)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, runner.device)
        torch.cuda.synchronize(runner.device)
    labels = [s.label for s in plan]
    logger.info(
        "warm-up: %d kernel variants in %.2f s (%s)",
        len(plan),
        time.perf_counter() - start,
        "; ".join(labels),
    )
    return labels


def synthetic_step(
    runner: ModelRunner, step: WarmStep, index: int, rng: np.random.Generator
) -> SchedulerOutput:
    """A step of new requests whose every page is the null page (the warm-up's, a profile's)."""
    new, scheduled = [], {}
    for j, r in enumerate(step.requests):
        req_id = f"warm-up-{index}-{j}"
        length = r.context + r.tokens
        prompt = rng.integers(0, runner.vocab_size, length).tolist()
        blocks = [NULL_BLOCK] * -(-length // runner.block_size)
        new.append(NewRequestData(req_id, prompt, [], r.params, None, blocks, r.context))
        scheduled[req_id] = r.tokens
    so = SchedulerOutput(new, [], scheduled, sum(scheduled.values()))
    if step.grammar:
        words = -(-runner.vocab_size // 32)
        so.grammar_req_ids = list(scheduled)
        so.grammar_bitmask = np.full(words * len(scheduled), -1, dtype=np.int32).tobytes()
    return so
