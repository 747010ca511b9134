"""KV transfer between engines: export a prefix's pages by hash, import them into another
engine's CPU tier (over host memory, on one machine), where a request with that prefix finds
and loads them like any other CPU-tier hit. Disaggregated prefill and decode build on this.

A bundle names the model it came from (path, architecture, KV shape, dtype, KV cache dtype, page
size): the hashes cover token ids only, so a bundle is refused by an engine running anything
else. An fp8 cache's pages travel as stored (fp8, with the same model's scales on both sides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inferengine.core.request import Request
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inferengine.engine.core import EngineCore


@dataclass
class KVBundle:
    fingerprint: tuple
    block_hashes: list[bytes]
    pages: list[torch.Tensor]  # per KV tensor of the model: [2, pages, block, kv_heads, dim]

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.fingerprint[-1]


def _fingerprint(core: EngineCore) -> tuple:
    m, cc = core.config.model_config, core.config.cache_config
    cache_dtype = "fp8_e4m3" if cc.cache_dtype == "fp8" else cc.cache_dtype  # one storage
    return (
        m.model_path, m.architecture, m.num_kv_heads, m.head_dim, m.dtype, cache_dtype,
        cc.block_size,
    )  # fmt: skip


def _check_idle(core: EngineCore, what: str) -> None:
    if core.config.parallel_config.world_size > 1:
        raise ConfigError(f"KV {what} works on one-rank engines only so far.")
    if core.scheduler.has_unfinished_requests():
        raise InvalidRequestError(f"KV {what} needs an idle engine: call it between generates.")
    while core._inflight:  # a trailing step with nothing left in it
        core.step()


def export_prefix(core: EngineCore, token_ids: list[int], cache_salt: str | None = None):
    """The pages of the longest cached run of full leading blocks of `token_ids`, from the
    GPU pool or the CPU tier."""
    _check_idle(core, "export")
    kv = core.scheduler.kv_cache_manager
    probe = Request(
        "kv-export",
        token_ids,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=core.scheduler.block_hasher,
        cache_salt=cache_salt,
    )
    hashes, locations = [], []
    for block_hash in probe.block_hashes:
        block = kv.pool.get_cached_block(block_hash)
        slot = kv.host.lookup(block_hash) if block is None and kv.host is not None else None
        if block is None and slot is None:
            break
        hashes.append(block_hash)
        locations.append(("gpu", block.block_id) if block is not None else ("host", slot))
    if kv.host is not None:
        kv.host.end_step()
    pages = core.executor.read_kv_pages(locations) if locations else []
    return KVBundle(_fingerprint(core), hashes, pages)


def import_prefix(core: EngineCore, bundle: KVBundle) -> int:
    """Put the bundle's pages into the CPU tier; returns how many were new here."""
    _check_idle(core, "import")
    kv = core.scheduler.kv_cache_manager
    if kv.host is None:
        raise ConfigError("importing KV pages needs a CPU tier: start with --kv-offloading-size.")
    if bundle.fingerprint != _fingerprint(core):
        raise InvalidRequestError(
            f"the KV bundle comes from another model or layout ({bundle.fingerprint}); this "
            f"engine runs {_fingerprint(core)}."
        )
    slots, indices = [], []
    for i, block_hash in enumerate(bundle.block_hashes):
        if kv.pool.get_cached_block(block_hash) is not None or block_hash in kv.host:
            continue
        slot = kv.host.reserve(block_hash)
        if slot is None:
            break
        slots.append(slot)
        indices.append(i)
    kv.host.end_step()
    if slots:
        index = torch.tensor(indices)
        core.executor.write_host_pages(slots, [p.index_select(1, index) for p in bundle.pages])
    return len(slots)
