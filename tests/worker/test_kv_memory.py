"""The CPU KV cache's default size, from what max_num_seqs requests of max_model_len need
within a budget from host memory and cgroup limits; its pages resident only once written; and a
max_model_len lowered to what the cache holds when the user did not set one."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from inferengine.engine import kv_sizing
from inferengine.errors import ConfigError
from inferengine.worker import kv_memory
from inferengine.worker.kv_memory import (
    CPU_HEADROOM_BYTES,
    FALLBACK_CPU_KV_BYTES,
    allocate_kv_caches,
    cpu_kv_budget,
    cpu_kv_pages,
    host_memory_available,
    kv_block_bytes,
    kv_cache_dtype,
    lazy_zeros,
    num_blocks_for_cpu,
    num_blocks_for_cuda,
    runs_eagerly,
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


# ---- page bytes, page tensors and the default page count, from an EngineConfig ------------


def _config(
    dtype="float32",
    cache_dtype="auto",
    tp=1,
    kv_heads=2,
    max_num_seqs=4,
    max_model_len=100,
    kv_cache_memory=None,
    draft: ModelConfig | None = None,
    enforce_eager=False,
) -> EngineConfig:
    """A tiny qwen2's shape: 2 layers, 4 heads of 16 dims, `kv_heads` KV heads, pages of 16."""
    hf = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, intermediate_size=128)  # fmt: skip
    spec = None
    if draft is not None:
        spec = SpeculativeConfig(
            method="draft_model", model="draft", num_speculative_tokens=2, draft_model_config=draft
        )
    return EngineConfig(
        model_config=ModelConfig("m", "", hf, dtype, max_model_len),
        cache_config=CacheConfig(
            block_size=16, cache_dtype=cache_dtype, kv_cache_memory=kv_cache_memory
        ),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        speculative_config=spec,
        enforce_eager=enforce_eager,
    )


def _draft() -> ModelConfig:
    hf = dict(vocab_size=320, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1)  # fmt: skip
    return ModelConfig("draft", "", hf, "float32", 100)


def test_page_bytes_from_layers_heads_dtype_and_split():
    assert kv_block_bytes(_config(), torch.float32) == PAGE_BYTES
    assert kv_cache_dtype(_config()) == torch.float32
    assert kv_cache_dtype(_config(dtype="bfloat16")) == torch.bfloat16
    assert kv_block_bytes(_config(dtype="bfloat16"), torch.bfloat16) == PAGE_BYTES // 2
    fp8 = _config(cache_dtype="fp8")
    assert kv_cache_dtype(fp8) == torch.float8_e4m3fn
    assert kv_block_bytes(fp8, kv_cache_dtype(fp8)) == PAGE_BYTES // 4
    # Tensor parallel: each rank holds its share of the KV heads, at least one (replicated).
    assert kv_block_bytes(_config(tp=2), torch.float32) == PAGE_BYTES // 2
    assert kv_block_bytes(_config(tp=4), torch.float32) == PAGE_BYTES // 2
    # A draft model's layers share the page ids: 1 layer x K,V x 1 head x 8 dims x 4 B x 16.
    assert kv_block_bytes(_config(draft=_draft()), torch.float32) == PAGE_BYTES + 1024


def test_page_tensors_per_layer():
    config = _config(draft=_draft())
    caches = allocate_kv_caches(config, 5, torch.float32, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, 16, 2, 16)] * 2
    assert all(c.dtype == torch.float32 and not c.any() for c in caches)
    caches[0][1, 3] = 1.0  # layers do not share memory
    assert not caches[1].any() and float(caches[0].sum()) == 16 * 2 * 16
    (draft,) = allocate_kv_caches(config, 5, torch.float32, torch.device("cpu"), _draft())
    assert tuple(draft.shape) == (2, 5, 16, 1, 8)
    assert lazy_zeros((0, 4), torch.float32).shape == (0, 4)


def test_default_cpu_pages_from_the_config(monkeypatch):
    logged: list[str] = []
    monkeypatch.setattr(kv_memory.logger, "info", lambda m, *a: logged.append(m % a))
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: 64 * GIB)
    assert num_blocks_for_cpu(_config(), torch.float32) == 28 + 7 + 1
    assert logged == [
        "CPU KV cache: 36 pages of 16 tokens, 0.00 GiB, resident as they fill "
        "(max_num_seqs=4 requests of max_model_len=100: 28 pages, 7 more for cached prefixes; "
        "--kv-cache-memory sets it)"
    ]
    # Little memory left: the headroom caps it at 20 pages.
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: GIB + 20 * PAGE_BYTES)
    assert num_blocks_for_cpu(_config(), torch.float32) == 20
    assert logged[-1].startswith("CPU KV cache: 20 pages of 16 tokens, 0.00 GiB")
    assert "would take 36 pages" in logged[-1]
    # Two ranks split the budget: half of 30 half-size pages' worth each.
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: GIB + 30 * PAGE_BYTES // 2)
    assert num_blocks_for_cpu(_config(tp=2), torch.float32) == 15
    # Unknown memory: 1 GiB, which 36 pages fit.
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: None)
    assert num_blocks_for_cpu(_config(), torch.float32) == 36


def test_kv_cache_memory_sets_the_pages_on_either_device(monkeypatch):
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: 64 * GIB)
    config = _config(kv_cache_memory=100 * PAGE_BYTES + PAGE_BYTES - 1)
    assert num_blocks_for_cpu(config, torch.float32) == 100
    # On CUDA it wins before any profiling (which would need a device).
    assert num_blocks_for_cuda(config, torch.float32, torch.device("cuda"), None) == 100


def test_page_counts_round_each_request_up_to_whole_pages():
    # 5 requests of 17 tokens: 2 pages each; ceil(10 / 4) = 3 more; the null page.
    assert cpu_kv_pages(PAGE_BYTES, 10 * GIB, "", 5, 17, 16)[0] == 14
    assert cpu_kv_pages(PAGE_BYTES, 10 * GIB, "", 1, 1, 16)[0] == 3  # 1 + ceil(0.25) + 1
    # A budget of exactly what is needed gives all of it; a byte less, one page less.
    assert cpu_kv_pages(PAGE_BYTES, 14 * PAGE_BYTES, "", 5, 17, 16)[0] == 14
    assert cpu_kv_pages(PAGE_BYTES, 14 * PAGE_BYTES - 1, "", 5, 17, 16)[0] == 13
    assert cpu_kv_pages(PAGE_BYTES, 0, "none left", 5, 17, 16)[0] == 0


def test_which_configs_run_eagerly():
    assert not runs_eagerly(_config())
    assert runs_eagerly(_config(enforce_eager=True))
    staged = _config()
    staged.parallel_config.pipeline_parallel_size = 2
    assert runs_eagerly(staged)
