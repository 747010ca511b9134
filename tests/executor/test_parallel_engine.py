"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): greedy tokens equal
one rank's and Transformers' (float32) through chunked prefill, preemption and prefix hits, for a
GQA and an MQA model; a worker that dies fails the engine within 5 s."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.errors import EngineDeadError
from tests.conftest import hf_greedy, hf_model

# GQA (4 heads over 2 KV heads, tied embeddings, 3 layers: stages of 2 and 1) and MQA (8 heads,
# one KV head, which 2 or 4 ranks replicate).
ARCHS = ["llama3-tied", "qwen3"]
LAYOUTS = {"tp2": (2, 1), "tp4": (4, 1), "tp8": (8, 1), "pp2": (1, 2), "tp2-pp2": (2, 2)}
# Gemma (its own decoder on the same parallel layers): both parallelisms at once.
CASES = [(a, layout) for a in ARCHS for layout in sorted(LAYOUTS) if layout != "tp8"] + [
    ("gemma2", "tp2-pp2"),
    ("gemma3", "tp2-pp2"),
    # Phi-3: its fused qkv and gate_up checkpoint tensors split into each rank's shards.
    ("phi3-longrope", "tp2"),
    # Eight ranks ([31]'s CPU run): qwen3's 8 heads one per rank, its one KV head replicated.
    ("qwen3", "tp8"),
]
LENGTHS = [3, 20, 45, 70, 130]
MAX_TOKENS = [14, 9, 12, 6, 10]
# Prompts go in chunks of at most 24 tokens, and 14 pages cannot hold every request at once.
SETTINGS = dict(
    max_model_len=160,
    max_num_batched_tokens=40,
    long_prefill_token_threshold=24,
    num_gpu_blocks_override=14,
    enable_prefix_caching=True,
)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in LENGTHS]


@functools.cache
def _expected(path: str) -> list[list[int]]:
    model = hf_model(path)
    return [hf_greedy(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS, strict=True)]


def _generate(llm: LLM):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_parallel_greedy_matches_one_rank_and_transformers(tiny_checkpoint, arch, layout):
    path = str(tiny_checkpoint(arch))
    tp, pp = LAYOUTS[layout]
    reference = LLM(path, **SETTINGS)
    one_rank = [_generate(reference), _generate(reference)]
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **SETTINGS)
    try:
        first = _generate(llm)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        second = _generate(llm)  # prompts whose pages survived find them cached
        tokens = [o.outputs[0].token_ids for o in first]
        assert tokens == [o.outputs[0].token_ids for o in one_rank[0]] == _expected(path)
        assert [o.outputs[0].token_ids for o in second] == tokens
        hits = [o.num_cached_tokens for o in second]
        assert sum(hits) > 0
        if pp == 1:  # pipelining splits the batches differently, so pages live differently
            assert hits == [o.num_cached_tokens for o in one_rank[1]]
    finally:
        llm.llm_engine.core.shutdown()


def test_killing_a_worker_fails_the_engine_within_5_s(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), tensor_parallel_size=2, max_model_len=512)
    executor = llm.llm_engine.core.executor
    victim = executor.procs[1]
    killed: list[float] = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    with pytest.raises(EngineDeadError, match=r"worker process rank 1 \(pid \d+\) exited"):
        for _ in range(1000):  # each call runs for a while; the kill lands in one of them
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
    assert time.monotonic() - killed[0] < 5
    time.sleep(0.5)
    assert all(p.exitcode is not None for p in executor.procs)  # nothing left behind
    with pytest.raises(EngineDeadError):
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)


def test_a_checkpoint_mistake_in_a_worker_keeps_its_error_class(tiny_checkpoint, tmp_path):
    """A rank that cannot load its weights reports the loader's own error, not a dead engine."""
    from safetensors.torch import load_file, save_file

    from inferengine.errors import ModelLoadError

    source = tiny_checkpoint("qwen3")
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"the checkpoint lacks 1 tensors .*model\.norm"):
        LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=128)


def test_a_dropped_engine_stops_its_workers(tiny_checkpoint):
    import gc

    llm = LLM(str(tiny_checkpoint("qwen3")), tensor_parallel_size=2, max_model_len=128)
    procs = list(llm.llm_engine.core.executor.procs)
    del llm
    gc.collect()
    deadline = time.monotonic() + 8
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.exitcode is not None for p in procs)


def test_pipeline_stages_overlap_over_disjoint_requests(tiny_checkpoint):
    """With two stages, two steps are in flight at once, never sharing a request (each one's
    next token depends on the other's), and the tokens are still Transformers' own."""
    path = str(tiny_checkpoint("qwen3"))
    llm = LLM(path, pipeline_parallel_size=2, max_model_len=128)
    core = llm.llm_engine.core
    launch = core.executor.execute_model_async
    launches: list[tuple[set[str], list[set[str]]]] = []

    def recording(so):
        in_flight = [set(s.num_scheduled_tokens) for s, _, _ in core._inflight]
        launches.append((set(so.num_scheduled_tokens), in_flight))
        return launch(so)

    core.executor.execute_model_async = recording
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 9, 4, 12, 7, 6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        core.shutdown()
    model = hf_model(path)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 8) for p in prompts]
    overlapped = [(new, old) for new, old in launches if new and any(old)]
    assert len(overlapped) >= 8  # about every step once the pipeline is full
    for new, old in overlapped:
        assert all(not new & step for step in old)
        assert 2 <= len(new) <= 4  # about half of the six requests each


def test_ngram_speculation_across_pipeline_stages_keeps_greedy_tokens(tiny_checkpoint):
    """Speculating steps run one at a time; the first stage learns the accepted tokens (not
    the drafts) from the next step."""
    path = str(tiny_checkpoint("qwen3"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(path, pipeline_parallel_size=2, max_model_len=128, speculative_config=spec)
    motif = [11, 12, 13, 14, 15, 16]
    prompts = [motif * 4, [7, 8] * 6 + motif, [30, 31, 32, 33]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.core.scheduler.spec_stats
    finally:
        llm.llm_engine.core.shutdown()
    model = hf_model(path)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 16) for p in prompts]
    assert stats.num_drafts > 0
