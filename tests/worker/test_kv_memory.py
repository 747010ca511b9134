"""The CPU KV cache's default size, from what max_num_seqs requests of max_model_len need
within a budget from host memory and cgroup limits; its pages resident only once written; and a
max_model_len lowered to what the cache holds when the user did not set one."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.engine import kv_sizing
from inferengine.errors import ConfigError
from inferengine.worker.kv_memory import (
    CPU_HEADROOM_BYTES,
    FALLBACK_CPU_KV_BYTES,
    cpu_kv_budget,
    cpu_kv_pages,
    host_memory_available,
    lazy_zeros,
)

GIB = 1 << 30
PAGE_BYTES = 8192  # tiny qwen2: 2 layers x K,V x 2 KV heads x head_dim 16 x 4 bytes x 16 tokens


def fake_host(tmp_path, meminfo_kib=None, cgroup=None):
    """A root folder with /proc/meminfo and, given `cgroup` = (version, files), cgroup files."""
    if meminfo_kib is not None:
        (tmp_path / "proc").mkdir()
        (tmp_path / "proc/meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemFree:          1000 kB\n"
            f"MemAvailable:   {meminfo_kib} kB\n"
        )
    if cgroup is not None:
        version, files = cgroup
        folder = tmp_path / ("sys/fs/cgroup" if version == 2 else "sys/fs/cgroup/memory")
        folder.mkdir(parents=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    return tmp_path


def test_meminfo_alone(tmp_path):
    assert host_memory_available(fake_host(tmp_path, meminfo_kib=24 * 1024 * 1024)) == 24 * GIB


def test_cgroup_v2_limit_below_host_memory(tmp_path):
    files = {
        "memory.max": f"{8 * GIB}\n",
        "memory.current": f"{3 * GIB}\n",
        "memory.stat": f"anon 123\ninactive_file {GIB}\nactive_file 5\n",
    }
    root = fake_host(tmp_path, meminfo_kib=24 * 1024 * 1024, cgroup=(2, files))
    assert host_memory_available(root) == 6 * GIB  # 8 - 3 + 1 reclaimable


def test_cgroup_v2_without_limit(tmp_path):
    files = {"memory.max": "max\n", "memory.current": f"{3 * GIB}\n"}
    root = fake_host(tmp_path, meminfo_kib=24 * 1024 * 1024, cgroup=(2, files))
    assert host_memory_available(root) == 24 * GIB


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    files = {"memory.limit_in_bytes": f"{4 * GIB}\n", "memory.usage_in_bytes": f"{GIB}\n"}
    root = fake_host(tmp_path, meminfo_kib=24 * 1024 * 1024, cgroup=(1, files))
    assert host_memory_available(root) == 3 * GIB
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory_available(root) == 24 * GIB


def test_nothing_readable(tmp_path):
    assert host_memory_available(tmp_path) is None
    assert cpu_kv_budget(None)[0] == FALLBACK_CPU_KV_BYTES


def test_budget_is_a_share_leaving_headroom():
    budget, why = cpu_kv_budget(24 * GIB)
    assert budget == int(24 * GIB * 0.3)
    assert "0.3 of the 24.0 GiB available" in why
    assert cpu_kv_budget(24 * GIB, share=0.5)[0] == int(24 * GIB * 0.3 * 0.5)  # two ranks
    # Little memory: the headroom decides; none left: nothing.
    assert cpu_kv_budget(CPU_HEADROOM_BYTES + GIB // 4)[0] == GIB // 4
    assert cpu_kv_budget(CPU_HEADROOM_BYTES // 2)[0] == 0


def test_default_max_model_len_lowered_to_what_the_cache_holds(tiny_checkpoint, monkeypatch):
    warnings: list[str] = []  # the package logger does not propagate to caplog
    monkeypatch.setattr(kv_sizing.logger, "warning", lambda m, *a: warnings.append(m % a))
    path = str(tiny_checkpoint("qwen2"))  # context length 1024
    llm = LLM(path, kv_cache_memory=40 * PAGE_BYTES)  # 39 usable pages: 624 tokens
    config = llm.llm_engine.config
    assert config.scheduler_config.max_model_len == 624
    assert config.model_config.max_model_len == 624
    assert any("max_model_len lowered to 624" in w for w in warnings)
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_explicit_max_model_len_that_does_not_fit_still_fails(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2"))
    with pytest.raises(ConfigError, match="Lower --max-model-len to 624 or less"):
        LLM(path, max_model_len=1024, kv_cache_memory=40 * PAGE_BYTES)


def test_default_is_what_max_num_seqs_requests_need_within_the_budget():
    # 4 requests of 100 tokens: 7 pages of 16 each, 28 in all; a quarter more (7) for cached
    # prefixes; and the null page.
    pages, why = cpu_kv_pages(PAGE_BYTES, 10 * GIB, "budget", 4, 100, 16)
    assert pages == 28 + 7 + 1
    requests = "max_num_seqs=4 requests of max_model_len=100"
    assert why == f"{requests}: 28 pages, 7 more for cached prefixes"
    # 3 requests of 16 tokens: 3 pages, ceil(0.75) = 1 more, the null page.
    assert cpu_kv_pages(PAGE_BYTES, 10 * GIB, "budget", 3, 16, 16)[0] == 5
    # The budget holds fewer: as many as it holds, and what the requests would have taken.
    pages, why = cpu_kv_pages(PAGE_BYTES, 30 * PAGE_BYTES + 100, "0.3 of 1 GiB", 4, 100, 16)
    assert pages == 30
    assert why == f"0.3 of 1 GiB; {requests} would take 36 pages (0.00 GiB)"


def test_default_never_exceeds_what_max_num_seqs_requests_fill(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen2")), max_model_len=128, max_num_seqs=4)
    assert llm.llm_engine.config.cache_config.num_blocks == 4 * 128 // 16 + 8 + 1


def test_an_explicit_kv_cache_memory_wins(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2"))
    llm = LLM(path, max_model_len=128, max_num_seqs=4, kv_cache_memory=100 * PAGE_BYTES)
    assert llm.llm_engine.config.cache_config.num_blocks == 100


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_cpu_pages_are_zeros_resident_only_once_written():
    before = _rss_bytes()
    cache = lazy_zeros((2, 4096, 16, 8, 64), torch.float32)  # 256 MiB
    assert _rss_bytes() - before < 32 << 20
    assert cache.is_contiguous() and not cache[:, ::512].any()  # reading maps no new memory
    cache[:, :2048] = 1.0  # half the pages written
    assert _rss_bytes() - before > 120 << 20
    assert float(cache.sum()) == 2 * 2048 * 16 * 8 * 64
