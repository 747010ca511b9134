"""KV transfer: one engine's prefix pages, exported by hash and imported into another engine's
CPU tier, are found and loaded there, and the tokens stay Transformers' own."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError, InvalidRequestError
from tests.conftest import hf_greedy, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_an_imported_prefix_is_loaded_not_recomputed(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    prefill = LLM(path, max_model_len=256)
    prompt = _prompt(70, 1)
    prefill.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    bundle = prefill.export_kv(prompt)
    assert len(bundle.block_hashes) == 4 and bundle.num_tokens == 64
    assert bundle.pages[0].shape[1] == 4

    decode = LLM(path, max_model_len=256, kv_offloading_size=0.002)
    assert decode.import_kv(bundle) == 4
    assert decode.import_kv(bundle) == 0  # already there
    longer = [*prompt, *range(5, 15)]
    (out,) = decode.generate([{"prompt_token_ids": longer}], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 64
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model(path), longer, 6)
    tiers = decode.llm_engine.core.scheduler.make_stats().kv_tiers
    assert (tiers.cpu_hit_tokens, tiers.loaded_blocks) == (64, 4)


def test_a_bundle_from_another_model_or_without_a_tier_is_refused(tiny_checkpoint):
    source = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128)
    prompt = _prompt(40, 2)
    source.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    bundle = source.export_kv(prompt)
    with pytest.raises(ConfigError, match="needs a CPU tier"):
        source.import_kv(bundle)
    other = LLM(str(tiny_checkpoint("llama3-tied")), max_model_len=128, kv_offloading_size=0.002)
    with pytest.raises(InvalidRequestError, match="another model or layout"):
        other.import_kv(bundle)


def _run(llm: LLM, request_id: str, prompt: list[int], cache_salt: str | None = None) -> None:
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, cache_salt=cache_salt)
    while engine.has_unfinished_requests():
        engine.step()


def test_export_takes_full_cached_blocks_under_the_same_salt_only(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128)
    prompt = _prompt(40, 3)  # 2 full blocks of 16, and 8 tokens
    nothing = llm.export_kv(prompt)
    assert (nothing.block_hashes, nothing.pages, nothing.num_tokens) == ([], [], 0)
    _run(llm, "salted", prompt, cache_salt="tenant-a")
    assert llm.export_kv(prompt).num_tokens == 0  # the pages hash under the salt
    assert llm.export_kv(prompt, cache_salt="tenant-b").num_tokens == 0
    bundle = llm.export_kv(prompt, cache_salt="tenant-a")
    assert bundle.num_tokens == 32 and len(bundle.block_hashes) == 2
    # the prefix of the prompt exports the same first block
    assert llm.export_kv(prompt[:20], cache_salt="tenant-a").block_hashes == bundle.block_hashes[:1]
    # one tensor per layer: [K and V, pages, block, kv heads, head dim]
    assert [tuple(p.shape) for p in bundle.pages] == [(2, 2, 16, 1, 32)] * 3


def test_transfer_needs_an_idle_engine(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, kv_offloading_size=0.002)
    empty = llm.export_kv(_prompt(20, 5))  # nothing cached: no pages, this engine's layout
    engine = llm.llm_engine
    engine.add_request("busy", {"prompt_token_ids": _prompt(20, 4)}, GREEDY)
    engine.step()
    with pytest.raises(InvalidRequestError, match="KV export needs an idle engine"):
        llm.export_kv(_prompt(20, 4))
    with pytest.raises(InvalidRequestError, match="KV import needs an idle engine"):
        llm.import_kv(empty)
    engine.abort_request(["busy"])
    assert llm.import_kv(empty) == 0  # idle again; an empty bundle adds nothing
