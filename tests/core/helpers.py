"""Small builders shared by the core tests: requests, schedulers, a fake model runner, pool checks."""

from __future__ import annotations

from collections.abc import Callable

from inferengine.config import CacheConfig, SchedulerConfig
from inferengine.core.block_pool import BlockPool
from inferengine.core.hashing import BlockHasher
from inferengine.core.kv_cache_manager import KVCacheManager
from inferengine.core.request import Request
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.core.scheduler import Scheduler
from inferengine.sampling_params import SamplingParams

EOS = 2


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    *,
    block_size: int | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = EOS,
    **params,
) -> Request:
    """A request; with `block_size` it hashes its blocks itself (for KV manager tests)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        block_hasher=BlockHasher(block_size) if block_size else None,
        arrival_time=0.0 if arrival_time is None else arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    max_model_len: int = 1024,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
) -> Scheduler:
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    return Scheduler(sched, cache)


def fake_runner_output(
    scheduler: Scheduler, output: SchedulerOutput, next_token: Callable[[Request], int]
) -> ModelRunnerOutput:
    """One sampled token for every scheduled request whose prompt is now fully computed."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([next_token(request)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler, token: int | Callable[[Request], int] = 7):
    """schedule() + a fake forward pass + update_from_output(); returns both outputs."""
    next_token = token if callable(token) else (lambda _request: token)
    output = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, output, next_token)
    return output, scheduler.update_from_output(output, runner_output)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def check_pool(pool: BlockPool, holders: dict[str, list[int]]) -> None:
    """Free list, reference counts and the hash map agree with each other and with `holders`."""
    free = free_ids(pool)
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert 0 not in free
    assert pool.null_block.ref_cnt == 1 and pool.null_block.block_hash is None
    held: dict[int, int] = {}
    for ids in holders.values():
        assert 0 not in ids
        assert len(ids) == len(set(ids))
        for block_id in ids:
            held[block_id] = held.get(block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == held.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free), block
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert len(free) + len(held) == pool.num_usable_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    brute = sum(1 for b in pool.free_queue if b.block_hash is not None)
    assert pool.num_cached_free_blocks == brute


def check_manager(manager: KVCacheManager) -> None:
    check_pool(manager.pool, {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks})
