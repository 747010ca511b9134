"""The step loop's modes against each other: synchronous or async scheduling; steps padded to
CUDA-graph shapes (run eagerly on the CPU) or not; no speculation, n-gram drafts or a draft
model; grammars; pipeline stages. Every mode gives the greedy tokens of a plain run, and the
steps add up exactly: every prompt token and every output token but the last is computed once,
plus the drafts that were rejected; a step verifying drafts never runs beside another, except
n-gram drafts made ahead behind a step that verifies none.

The draft policy is pinned (it speculates and keeps every draft; it decides from measured step
times otherwise), and requests end by length only (`ignore_eos`), so nothing is left to timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.sampling_params import StructuredOutputsParams
from inferengine.spec_decode.draft_policy import DraftLengthPolicy
from tests.conftest import hf_greedy, hf_model

ARCH = "llama3-tied"
K = 3
MAX_TOKENS = [12, 7, 16, 9]
GRAMMAR = StructuredOutputsParams(regex="[a-z]{300}")  # never complete within MAX_TOKENS
SETTINGS = dict(max_model_len=256, max_num_batched_tokens=512, enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    # Repeating motifs, so that the n-gram lookup finds continuations.
    return [torch.randint(2, 320, (n,), generator=g).tolist() * 3 for n in (5, 9, 4, 11)]


def _params(grammar: bool) -> list[SamplingParams]:
    structured = GRAMMAR if grammar else None
    return [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, structured_outputs=structured)
        for m in MAX_TOKENS
    ]


def _spec(kind: str | None, path: str) -> dict | None:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
    if kind == "draft_model":  # the target as its own draft: every draft is accepted
        return {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    return None


@dataclass
class Launch:
    tokens: int  # tokens scheduled
    drafts: int  # of which drafts
    beside: int  # steps in flight when it was launched
    beside_drafts: bool  # whether one of those verifies drafts


@dataclass
class Run:
    tokens: list[list[int]]
    launches: list[Launch]
    draft_tokens: int  # drafts verified
    accepted: int  # of which accepted
    kinds: list[str]  # the padded shapes the steps ran in

    @property
    def steps(self) -> int:
        return sum(1 for launch in self.launches if launch.tokens)


def _run(llm: LLM, grammar: bool) -> Run:
    """One batch, watching every step the engine core launches."""
    core = llm.llm_engine.core
    launches: list[Launch] = []
    launch = core.executor.execute_model_async
    graphs = getattr(getattr(core.executor, "worker", None), "runner", None)
    graphs = graphs.graphs if graphs is not None else None
    kinds: list[str] = []
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda shape: kinds.append(shape.kind) or replay(shape)

    def watching(so):
        inflight = [s for s, _, _ in core._inflight]
        drafts = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        verifying = any(s.scheduled_spec_decode_tokens for s in inflight)
        launches.append(Launch(so.total_num_scheduled_tokens, drafts, len(inflight), verifying))
        return launch(so)

    stats = core.scheduler.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    core.executor.execute_model_async = watching
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        outputs = llm.generate(prompts, _params(grammar), use_tqdm=False)
        while core.has_unfinished_requests():  # a trailing step with nothing left in it
            core.step()
    finally:
        core.executor.execute_model_async = launch
        if graphs is not None:
            graphs.replay = replay
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(MAX_TOKENS)
    return Run(
        [list(o.outputs[0].token_ids) for o in outputs],
        launches,
        stats.num_draft_tokens - before[0],
        stats.num_accepted_tokens - before[1],
        kinds,
    )


def _check_counts(run: Run, spec: str | None, overlap: bool, grammar: bool = False) -> None:
    """The exact sums every mode keeps, and which steps ran beside which."""
    computed = sum(len(p) for p in _prompts()) + sum(m - 1 for m in MAX_TOKENS)
    assert sum(launch.tokens for launch in run.launches) == computed + (
        run.draft_tokens - run.accepted
    )
    assert sum(launch.drafts for launch in run.launches) == run.draft_tokens
    assert not any(launch.beside_drafts for launch in run.launches)
    ahead = [launch for launch in run.launches if launch.drafts and launch.beside]
    if spec is None:
        assert run.draft_tokens == 0 and run.steps == max(MAX_TOKENS)
    else:
        assert run.draft_tokens > 0 and run.steps <= max(MAX_TOKENS)
    # The target as its own draft (unmasked: a grammar masks only the target's tokens).
    if spec == "draft_model" and not grammar:  # every step emits 1 + K tokens
        assert run.accepted == run.draft_tokens
        assert run.steps == max(1 + -(-(m - 1) // (1 + K)) for m in MAX_TOKENS)
    if spec != "ngram" or not overlap:
        assert not ahead  # drafts ahead come only from a token proposer, two steps in flight
    if not overlap:
        assert not any(launch.beside for launch in run.launches)
    elif spec is None:
        assert sum(1 for launch in run.launches if launch.beside) >= run.steps - 1


@pytest.fixture(autouse=True)
def pinned_policy(monkeypatch):
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, n: True)
    monkeypatch.setattr(
        DraftLengthPolicy,
        "num_drafts",
        lambda self, request_id, available, batch_tokens, padded=False: available,
    )


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The plain run's tokens (synchronous, unpadded, no speculation), without and with the
    grammar; without it, Transformers' own."""
    path = tiny_checkpoint(ARCH)
    llm = LLM(str(path), async_scheduling=False, **SETTINGS)
    plain, grammar = (_run(llm, g).tokens for g in (False, True))
    model = hf_model(path)
    expected = [hf_greedy(model, p, m) for p, m in zip(_prompts(), MAX_TOKENS, strict=True)]
    assert plain == expected
    assert grammar != plain  # the grammar changed what the model says
    return {False: plain, True: grammar}


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_mode_keeps_the_plain_tokens_and_exact_step_sums(
    tiny_checkpoint, reference, spec, async_scheduling
):
    path = str(tiny_checkpoint(ARCH))
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=_spec(spec, path),
              **SETTINGS)  # fmt: skip
    runner = llm.llm_engine.core.executor.worker.runner
    eager = _run(llm, grammar=False)
    runner.capture_cuda_graphs([1, 2, 4], [64, 128, 256], capture=False)
    padded = _run(llm, grammar=False)
    grammar = _run(llm, grammar=True)
    assert eager.tokens == padded.tokens == reference[False]
    assert grammar.tokens == reference[True]
    # Prompts run in mixed shapes; decodes in decode shapes, or verify shapes with drafts.
    assert not eager.kinds and "mixed" in padded.kinds
    assert set(padded.kinds) - {"mixed"} == ({"decode"} if spec is None else {"verify"})
    for run in (eager, padded):
        _check_counts(run, spec, overlap=async_scheduling)
    # Grammars need every token before the next step's masks: drafts are never made ahead.
    _check_counts(grammar, spec, overlap=async_scheduling and spec is None, grammar=True)
    if spec == "ngram" and async_scheduling:
        assert any(launch.drafts and launch.beside for launch in eager.launches)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_pipeline_stages_keep_the_plain_tokens_and_exact_step_sums(
    tiny_checkpoint, reference, spec
):
    """Two stages keep two steps in flight over disjoint requests; a speculating step runs
    alone (the stages cannot take a token from each other's device)."""
    path = str(tiny_checkpoint(ARCH))
    llm = LLM(path, pipeline_parallel_size=2, speculative_config=_spec(spec, path), **SETTINGS)
    try:
        plain = _run(llm, grammar=False)
        grammar = _run(llm, grammar=True)
    finally:
        llm.llm_engine.core.shutdown()
    assert plain.tokens == reference[False] and grammar.tokens == reference[True]
    for run in (plain, grammar):
        _check_counts_pipelined(run, spec)


def _check_counts_pipelined(run: Run, spec: str | None) -> None:
    computed = sum(len(p) for p in _prompts()) + sum(m - 1 for m in MAX_TOKENS)
    assert sum(launch.tokens for launch in run.launches) == computed + (
        run.draft_tokens - run.accepted
    )
    assert not any(launch.beside_drafts for launch in run.launches)
    assert not any(launch.drafts and launch.beside for launch in run.launches)
    if spec is None:
        assert run.draft_tokens == 0
        assert any(launch.tokens and launch.beside for launch in run.launches)
    else:
        assert run.draft_tokens > 0
