"""N-gram speculative decoding through the engine changes no output: greedy tokens equal those
of plain decoding token for token (mixed batches, chunked prefill, preemption, prefix hits), and
requests that may not speculate (seeded sampling, penalties, logprobs) decode as before."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip


def _requests():
    g = torch.Generator().manual_seed(3)
    # Repeating prompts, so the n-gram lookup finds continuations to propose.
    base = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 9, 13, 6, 17, 8)]
    prompts = [b * 4 for b in base]
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=33, stop_token_ids=[17, 18]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=18, top_k=20),
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0, max_tokens=37, min_tokens=5),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(path: str, spec: dict | None, **kwargs):
    llm = LLM(path, max_model_len=256, speculative_config=spec, **kwargs)
    prompts, params = _requests()
    # Twice: the second round hits the prefix cache.
    outputs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    core = llm.llm_engine.core
    for _ in range(3):  # collect a step launched before the last requests were known done
        if core.has_unfinished_requests():
            core.step()
    pool = core.scheduler.kv_cache_manager.pool
    assert not core.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_usable_blocks
    tokens = [[(c.token_ids, c.finish_reason) for c in o.outputs] for out in outputs for o in out]
    logprobs = [o.outputs[0].logprobs for out in outputs for o in out]
    return tokens, logprobs, core.scheduler.spec_stats, core.spec.num_steps_drafted_ahead


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 40},  # chunked prefill, drafts trimmed to the budget
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 24},  # preemption
    ],
)
@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_ngram_greedy_matches_plain_decoding(tiny_checkpoint, arch, kwargs):
    path = str(tiny_checkpoint(arch))
    plain, plain_lp, _, _ = _run(path, None, **kwargs)
    spec, spec_lp, stats, drafted_ahead = _run(path, SPEC, **kwargs)
    assert spec == plain
    # Steps after steps without drafts were drafted past the token then on its way.
    assert drafted_ahead > 0
    # Logprobs of the same tokens; the batches differ (drafts add rows), so only up to float
    # rounding.
    for a, b in zip(spec_lp, plain_lp, strict=True):
        assert (a is None) == (b is None)
        for pos_a, pos_b in zip(a or [], b or [], strict=True):
            assert pos_a.keys() == pos_b.keys()
            for tok in pos_a:
                assert pos_a[tok].logprob == pytest.approx(pos_b[tok].logprob, abs=1e-4)
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


def test_target_as_its_own_draft_accepts_every_draft_it_can(tiny_checkpoint):
    """A prompt that repeats what the model will say: every proposal the lookup makes from the
    model's own greedy continuation is accepted."""
    path = str(tiny_checkpoint("llama3-tied"))
    llm = LLM(path, max_model_len=256)
    prompt = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=60)
    cont = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    said = list(cont.outputs[0].token_ids)
    # The prompt already holds the model's continuation; asking again retraces it.
    spec_llm = LLM(path, max_model_len=256, speculative_config=SPEC)
    again = spec_llm.generate(
        [{"prompt_token_ids": prompt + said[:30] + prompt}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    plain = llm.generate(
        [{"prompt_token_ids": prompt + said[:30] + prompt}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert list(again.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    stats = spec_llm.llm_engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.5
    assert stats.mean_accepted_length > 1.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "not supported yet"),
        ({"method": "nope", "num_speculative_tokens": 3}, "unknown speculative method"),
        ('{"method": "ngram", ', "not valid JSON"),
    ],
)
def test_bad_speculative_configs_fail_at_start_up(tiny_checkpoint, spec, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_checkpoint("llama3-tied")), max_model_len=256, speculative_config=spec)


def test_spec_metrics_under_vllms_names():
    from inferengine.core.engine_io import SchedulerStats, SpecDecodingStats
    from inferengine.engine.async_llm import _spec_stats
    from inferengine.metrics.prometheus import PrometheusStatLogger

    spec = SpecDecodingStats()
    spec.add(4, 2)
    spec.add(3, 3)
    assert spec.num_accepted_tokens_per_pos == [2, 2, 1, 0]
    logger = PrometheusStatLogger("m", 256, 64)
    logger.update_scheduler_stats(SchedulerStats(spec_decoding=spec))
    logger.update_scheduler_stats(SchedulerStats(spec_decoding=spec))  # no double counting
    text = logger.render().decode()
    assert 'spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'spec_decode_num_draft_tokens_total{model_name="m"} 7.0' in text
    assert 'spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    stats = _spec_stats(spec)
    assert stats["acceptance_rate"] == round(5 / 7, 6)
    assert stats["mean_accepted_length"] == 3.5
    assert _spec_stats(None) is None


def test_cli_flag_builds_the_config(tiny_checkpoint):
    import argparse

    from inferengine.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        [str(tiny_checkpoint("qwen2")), "--speculative-config", '{"num_speculative_tokens": 3}']
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    # Async scheduling stays on: the core runs only the steps that speculate synchronously.
    assert config.scheduler_config.async_scheduling is True
    plain = EngineArgs(model=str(tiny_checkpoint("qwen2"))).create_engine_config()
    assert plain.speculative_config is None


def test_a_batch_the_policy_turns_off_runs_as_plain_async_decoding(tiny_checkpoint, monkeypatch):
    """k = 0 for the whole batch: no draft, the proposer only probed now and then (a few
    requests every PROBE_EVERY steps), and steps go back to async scheduling (the next step is
    launched before the last one is collected)."""
    from inferengine.spec_decode.coordinator import PROBE_EVERY, PROBE_REQUESTS
    from inferengine.spec_decode.draft_policy import DraftLengthPolicy
    from inferengine.spec_decode.ngram import NgramProposer

    path = str(tiny_checkpoint("llama3-tied"))
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, n: False)
    calls, proposed = [], []
    probe, propose = NgramProposer.probe, NgramProposer.propose

    def counting(self, *args, **kwargs):
        calls.append(1)
        return probe(self, *args, **kwargs)

    def proposing(self, *args, **kwargs):
        proposed.append(1)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(NgramProposer, "probe", counting)
    monkeypatch.setattr(NgramProposer, "propose", proposing)
    prompts, params = _requests()
    plain = LLM(path, max_model_len=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, max_model_len=256, speculative_config=SPEC)
    core = llm.llm_engine.core
    overlapped = []
    step = core.step

    def watching_step():
        out = step()
        overlapped.append(bool(core._inflight))
        return out

    monkeypatch.setattr(core, "step", watching_step)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert core.scheduler.spec_stats.num_drafts == 0
    assert sum(overlapped) > len(overlapped) // 2
    assert 0 < len(calls) <= (len(overlapped) // PROBE_EVERY + 1) * PROBE_REQUESTS
    assert not proposed and not core.spec.proposer._indexes  # probes build no index


def test_a_batch_with_nothing_to_draft_stops_speculating_at_once(tiny_checkpoint):
    """Random prompts sampled at temperature 1 give the lookup nothing: after the first step
    finds no draft for anyone, steps run as plain async decoding (no proposer call but the
    occasional probe)."""
    path = str(tiny_checkpoint("llama3-tied"))
    spec = {**SPEC, "prompt_lookup_min": 3}
    llm = LLM(path, max_model_len=256, speculative_config=spec)
    core = llm.llm_engine.core
    speculated = []
    plan = core.spec.plan

    def watching(flag, so, ro):
        speculated.append(flag)
        return plan(flag, so, ro)

    core.spec.plan = watching
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(2, 320, (30,), generator=g).tolist()}
               for _ in range(16)]  # fmt: skip
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=60), use_tqdm=False)
    assert core.scheduler.spec_stats.num_drafts == 0
    assert len(speculated) > 50 and sum(speculated) <= 3


def test_a_step_verifies_at_most_max_drafts_per_step(tiny_checkpoint, monkeypatch):
    """The drafts of one step stay within the logits rows start-up reserved memory for
    (MAX_DRAFTS_PER_STEP, here lowered to 5): the same tokens, fewer drafts a step."""
    import inferengine.spec_decode.coordinator as coordinator

    monkeypatch.setattr(coordinator, "MAX_DRAFTS_PER_STEP", 5)
    path = str(tiny_checkpoint("llama3-tied"))
    plain, _, _, _ = _run(path, None)
    llm = LLM(path, max_model_len=256, speculative_config=SPEC)
    core = llm.llm_engine.core
    per_step = []
    launch = core._launch

    def watching(depth, speculate):
        launched = launch(depth, speculate)
        if core._inflight:
            drafts = core._inflight[-1][0].scheduled_spec_decode_tokens
            per_step.append(sum(len(d) for d in drafts.values()))
        return launched

    monkeypatch.setattr(core, "_launch", watching)
    prompts, params = _requests()
    out = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    tokens = [[(c.token_ids, c.finish_reason) for c in o.outputs] for r in out for o in r]
    assert tokens == plain
    assert max(per_step) == 5 and core.scheduler.spec_stats.num_accepted_tokens > 0


def test_start_up_reserves_a_logits_row_per_request_and_per_allowed_draft():
    from inferengine.config import MAX_DRAFTS_PER_STEP, SpeculativeConfig

    spec = SpeculativeConfig("ngram", 12)
    assert spec.max_logits_rows(8) == 8 + 8 * 12
    assert spec.max_logits_rows(256) == 256 + MAX_DRAFTS_PER_STEP
