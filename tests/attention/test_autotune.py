"""`--attention-backend-benchmark`: the fastest usable backend, timed once per device and shape."""

import json

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.attention import autotune
from inferengine.attention.autotune import AttentionShape, Workload, choose_backend
from inferengine.attention.backends.base import AttentionBackend
from inferengine.attention.backends.flex import flex_available
from inferengine.attention.backends.torch_ref import TorchAttentionBackend

SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
TINY = Workload(decode_batch=2, decode_context=9, prefill_tokens=7, repeats=1)
CPU = torch.device("cpu")


class SlowTorch(TorchAttentionBackend):
    name = "slow"

    def forward(self, *args):
        out = super().forward(*args)
        for _ in range(20):
            super().forward(*args)
        return out


class Wrong(TorchAttentionBackend):
    """Fast and wrong: must never win."""

    name = "wrong"

    def forward(self, spec, query, key, value, kv_cache, metadata):
        return torch.zeros_like(query)


class Broken(AttentionBackend):
    name = "broken"

    def forward(self, *args):
        raise RuntimeError("cannot run this shape")


def test_picks_the_fastest_and_remembers_it(tmp_path, monkeypatch):
    candidates = {
        "slow": SlowTorch,
        "torch": TorchAttentionBackend,
        "broken": Broken,
        "wrong": Wrong,
    }
    choice = choose_backend(SHAPE, CPU, candidates, tmp_path, TINY)
    assert choice.backend == "torch" and not choice.cached
    assert set(choice.timings_ms) == {"slow", "torch"}  # failing and wrong ones are left out
    assert choice.timings_ms["slow"] > choice.timings_ms["torch"] > 0
    saved = json.loads((tmp_path / autotune.CACHE_FILE).read_text())
    [(key, entry)] = saved.items()
    assert key.startswith(SHAPE.key(CPU)) and "candidates broken,slow,torch,wrong" in key
    assert entry["backend"] == "torch"

    def no_timing(*args):
        raise AssertionError("a cached choice must not be timed again")

    monkeypatch.setattr(autotune, "time_backend", no_timing)
    again = choose_backend(SHAPE, CPU, candidates, tmp_path, TINY)
    assert again.backend == "torch" and again.cached
    assert again.timings_ms == choice.timings_ms


def test_another_shape_or_a_damaged_file_is_timed_afresh(tmp_path):
    candidates = {"torch": TorchAttentionBackend}
    choose_backend(SHAPE, CPU, candidates, tmp_path, TINY)
    other = AttentionShape(4, 4, 16, 4, torch.float32)
    assert not choose_backend(other, CPU, candidates, tmp_path, TINY).cached
    assert len(json.loads((tmp_path / autotune.CACHE_FILE).read_text())) == 2
    (tmp_path / autotune.CACHE_FILE).write_text("{not json")
    assert not choose_backend(SHAPE, CPU, candidates, tmp_path, TINY).cached


def test_a_cached_backend_no_longer_usable_is_timed_afresh(tmp_path):
    choose_backend(SHAPE, CPU, {"slow": TorchAttentionBackend}, tmp_path, TINY)
    choice = choose_backend(SHAPE, CPU, {"torch": TorchAttentionBackend}, tmp_path, TINY)
    assert choice.backend == "torch" and not choice.cached


def test_no_usable_backend_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="no attention backend"):
        choose_backend(SHAPE, CPU, {"broken": Broken}, tmp_path, TINY)


def test_engine_benchmarks_at_start_up(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path))
    path = tiny_checkpoint("qwen2")
    llm = LLM(str(path), max_model_len=128, attention_backend_benchmark=True)
    executor = llm.llm_engine.core.executor
    assert executor.attention_backend_name in executor.attention_backend_timings_ms
    assert set(executor.attention_backend_timings_ms) <= {"cpu", "torch", "flex"}
    assert {"cpu", "torch"} <= set(executor.attention_backend_timings_ms)
    if flex_available():
        assert "flex" in executor.attention_backend_timings_ms
    saved = json.loads((tmp_path / autotune.CACHE_FILE).read_text())
    assert [entry["backend"] for entry in saved.values()] == [executor.attention_backend_name]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
