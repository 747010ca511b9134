"""`--kv-cache-dtype fp8` on the CPU (torch reference backend): the cache holds 4x the pages of
a float32 one (2x of a bfloat16 one) in the same memory, next-token choices agree with the
full-precision cache on most positions (GQA, sliding window, soft-capping), and prefix hits,
preemption, the CPU tier and KV transfer handle fp8 pages."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.worker.kv_memory import kv_cache_dtype

MEMORY = 4 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The next-token argmax at every prompt position (prompt_logprobs: top 1 and the actual token).
TEACHER_FORCED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)


def prompts(seed: int, lengths=(40, 90, 130, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


def requests(token_lists: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in token_lists]


def argmax_per_position(llm: LLM, token_lists: list[list[int]]) -> list[int]:
    outs = llm.generate(requests(token_lists), TEACHER_FORCED, use_tqdm=False)
    return [
        max(position.items(), key=lambda item: item[1].logprob)[0]
        for out in outs
        for position in out.prompt_logprobs[1:]
    ]


def agreement(a: list, b: list) -> float:
    assert len(a) == len(b)
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def num_blocks(llm: LLM) -> int:
    return llm.llm_engine.core.config.cache_config.num_blocks


@pytest.mark.parametrize("arch", ["qwen3", "mistral-window", "gemma2"])
def test_fp8_agrees_with_the_full_precision_cache(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    full = LLM(path, max_model_len=256, kv_cache_memory=MEMORY)
    fp8 = LLM(path, max_model_len=256, kv_cache_memory=MEMORY, kv_cache_dtype="fp8")
    # float32 pages are 4 bytes an element, fp8 pages 1.
    assert num_blocks(fp8) // num_blocks(full) == 4
    token_lists = prompts(3)
    match = agreement(argmax_per_position(full, token_lists), argmax_per_position(fp8, token_lists))
    assert match >= 0.9, f"next-token argmax agrees on {match:.1%} of positions"
    greedy_full = full.generate(requests(token_lists), GREEDY, use_tqdm=False)
    greedy_fp8 = fp8.generate(requests(token_lists), GREEDY, use_tqdm=False)
    # Greedy runs part ways at their first different choice; the first tokens mostly agree.
    firsts = [(a.outputs[0].token_ids[0], b.outputs[0].token_ids[0])
              for a, b in zip(greedy_full, greedy_fp8, strict=True)]  # fmt: skip
    assert sum(x == y for x, y in firsts) >= 3


def test_bfloat16_pages_halve(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    common = dict(max_model_len=256, kv_cache_memory=MEMORY, dtype="bfloat16")
    blocks = {d: num_blocks(LLM(path, kv_cache_dtype=d, **common)) for d in ("auto", "fp8_e4m3")}
    assert blocks["fp8_e4m3"] // blocks["auto"] == 2


def test_prefix_hits_read_the_same_fp8_pages(tiny_checkpoint):
    """A prompt computed fresh and one found in the prefix cache see the same quantized keys,
    so greedy tokens are the same (no mix of fresh full-precision and cached fp8 keys)."""
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=256, kv_cache_dtype="fp8")
    token_lists = prompts(4, lengths=(70, 100))
    first = llm.generate(requests(token_lists), GREEDY, use_tqdm=False)
    again = llm.generate(requests(token_lists), GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens >= 64 for out in again)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_preempted_requests_recompute_into_fp8_pages(tiny_checkpoint):
    """Requests preempted for want of pages (theirs freed, recomputed later) end as they do
    with room to spare."""
    path = str(tiny_checkpoint("qwen3"))
    token_lists = prompts(9, lengths=(60, 90, 45, 120, 75))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = LLM(path, max_model_len=256, num_gpu_blocks_override=24, kv_cache_dtype="fp8",
                max_num_batched_tokens=128)  # fmt: skip
    roomy = LLM(path, max_model_len=256, kv_cache_dtype="fp8")
    squeezed = tight.generate(requests(token_lists), params, use_tqdm=False)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    expected = roomy.generate(requests(token_lists), params, use_tqdm=False)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids
            for a, b in zip(squeezed, expected, strict=True)]  # fmt: skip
    assert sum(same) >= 4


def test_the_cpu_tier_moves_fp8_pages_exactly(tiny_checkpoint):
    """Pages pushed out of a 12-page pool to the CPU tier and loaded back give the tokens a
    recompute gives."""
    from tests.worker.test_kv_offload import OFFLOAD_GIB, _turns

    path = str(tiny_checkpoint("qwen3"))
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, 320, (70,), generator=g).tolist()
    fillers = [torch.randint(2, 320, (120,), generator=g).tolist() for _ in range(2)]
    # fp8 pages are a quarter the size: the same 12 pages, a quarter of the tier's GiB.
    settings = dict(max_model_len=176, num_gpu_blocks_override=12, kv_cache_dtype="fp8")
    tiered = LLM(path, kv_offloading_size=OFFLOAD_GIB / 4, **settings)
    _, one, two, out = _turns(tiered, first, fillers)
    tiers = tiered.llm_engine.core.scheduler.make_stats().kv_tiers
    assert tiers.cpu_hit_tokens >= 64 and out.num_cached_tokens >= 64
    _, one_again, two_again, recomputed = _turns(LLM(path, **settings), first, fillers)
    assert recomputed.num_cached_tokens == 0
    assert (one, two) == (one_again, two_again)


def test_kv_transfer_carries_fp8_pages_and_refuses_a_full_precision_engine(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    prompt = prompts(6, lengths=(70,))[0]
    longer = [*prompt, *range(5, 15)]
    source = LLM(path, max_model_len=256, kv_cache_dtype="fp8")
    source.generate(requests([prompt]), GREEDY, use_tqdm=False)
    bundle = source.export_kv(prompt)
    assert bundle.pages[0].dtype == torch.float8_e4m3fn and bundle.num_tokens == 64
    (expected,) = source.generate(requests([longer]), GREEDY, use_tqdm=False)

    # "fp8" and "fp8_e4m3" name one storage.
    target = LLM(path, max_model_len=256, kv_cache_dtype="fp8_e4m3", kv_offloading_size=0.001)
    assert target.import_kv(bundle) == 4
    (out,) = target.generate(requests([longer]), GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids

    full = LLM(path, max_model_len=256, kv_offloading_size=0.002)
    with pytest.raises(InvalidRequestError, match="another model or layout"):
        full.import_kv(bundle)


def test_kv_cache_dtype_names(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))

    def config(name: str):
        return EngineArgs(model=path, max_model_len=128, kv_cache_dtype=name).create_engine_config()

    assert kv_cache_dtype(config("auto")) == torch.float32
    assert kv_cache_dtype(config("fp8")) == torch.float8_e4m3fn
    assert kv_cache_dtype(config("fp8_e4m3")) == torch.float8_e4m3fn
    assert kv_cache_dtype(config("fp8_e5m2")) == torch.float8_e5m2
    for name in ("int8", "fp8_inc", "float16"):
        with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8"):
            config(name)
