"""What each rank reports at start-up (place, links, all-reduce by message size, memory) and
the start-up log an executor of several ranks writes from those reports."""

from __future__ import annotations

import os
import resource
import socket
from dataclasses import dataclass
from typing import Any

from inferengine.config import EngineConfig
from inferengine.logger import init_logger

logger = init_logger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class RankPlace:
    node: str  # the host name (worker processes) or the Ray node id (Ray actors)
    device_index: int  # the CUDA device this rank drives (ignored on the CPU)
    address: str = ""  # the node's IP where ranks span nodes (Ray), for the log


# ---- in the rank -----------------------------------------------------------------------------


def message_sizes(config: EngineConfig, dtype_bytes: int) -> list[tuple[str, int]]:
    """The tensor-parallel all-reduce messages of one layer output at the step shapes that
    matter: a decode of one request, a full decode batch, a full prefill budget."""
    m, sc = config.model_config, config.scheduler_config
    hidden = int(m.hf_config.get("hidden_size") or m.num_attention_heads * m.head_dim)
    row = hidden * dtype_bytes
    return [
        ("decode x1", row),
        (f"decode x{sc.max_num_seqs}", row * sc.max_num_seqs),
        (f"prefill {sc.max_num_batched_tokens} tokens", row * sc.max_num_batched_tokens),
    ]


def ready_info(worker: Any, place: RankPlace) -> dict[str, Any]:
    """A rank's report once its model is loaded. A collective (the links): every rank sends it."""
    import torch

    from inferengine.distributed.parallel_state import all_reduce_by_size, all_reduce_name
    from inferengine.distributed.topology import device_label, peer_links

    sizes = message_sizes(worker.config, worker.dtype.itemsize)
    paths = all_reduce_by_size([n for _, n in sizes], worker.dtype)
    if worker.device.type == "cuda":
        weights = torch.cuda.memory_allocated(worker.device)
    else:
        weights = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
    return {
        "attention_backend": worker.attn_backend.name,
        "attention_backend_timings_ms": worker.attn_timings_ms,
        "all_reduce": all_reduce_name(),
        "all_reduce_by_size": [
            [label, n, path] for (label, n), path in zip(sizes, paths, strict=True)
        ],
        "dtype": str(worker.dtype).removeprefix("torch."),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "node": place.node,
        "address": place.address,
        "device": device_label(worker.device),
        "links": peer_links(place.node, worker.device),
        "weights_bytes": weights,
    }


def memory_info(worker: Any) -> dict[str, int]:
    """A rank's memory once its KV cache is allocated: device memory on GPU (allocated,
    reserved by torch's allocator, total); resident memory on the CPU (the KV cache's pages
    count once written)."""
    import torch

    kv = sum(t.numel() * t.element_size() for t in worker.runner.kv_caches)
    if worker.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(worker.device)
        return {
            "kv_bytes": kv,
            "allocated": torch.cuda.memory_allocated(worker.device),
            "reserved": torch.cuda.memory_reserved(worker.device),
            "used": total - free,
            "total": total,
        }
    return {"kv_bytes": kv, "rss": resident_bytes()}


def resident_bytes() -> int:
    """This process's resident set (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- in the executor -------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def log_ranks(infos: dict[int, dict[str, Any]]) -> None:
    """Each rank's place, weights and attention, the links between ranks, and the all-reduce
    of each message size."""
    for rank, info in sorted(infos.items()):
        where = ", ".join(filter(None, [info["host"], info.get("address")]))
        node = info["node"] if info["node"] == info["host"] else f"{info['node'][:12]} ({where})"
        logger.info(
            "rank %d: node %s, pid %d, %s; weights %s, attention %s",
            rank,
            node,
            info["pid"],
            info["device"],
            _size(info["weights_bytes"]),
            info["attention_backend"],
        )
    links = sorted(
        {
            (min(a, int(b)), max(a, int(b)), how)
            for a, i in infos.items()
            for b, how in i["links"].items()
        }
    )
    if links:
        logger.info("rank links: %s", ", ".join(f"{a}-{b} {how}" for a, b, how in links))
    first = infos[min(infos)]
    plan = "; ".join(
        f"{label} {_size(n)}: {path}" for label, n, path in first["all_reduce_by_size"]
    )
    logger.info("tensor-parallel all-reduce (%s) by message size: %s", first["dtype"], plan)


def log_memory(memories: dict[int, dict[str, int]]) -> None:
    for rank, m in sorted(memories.items()):
        if "rss" in m:
            logger.info(
                "rank %d memory: RSS %s, KV cache %s", rank, _size(m["rss"]), _size(m["kv_bytes"])
            )
        else:
            logger.info(
                "rank %d memory: %s of %s in use (torch: %s allocated, %s reserved), KV cache %s",
                rank,
                _size(m["used"]),
                _size(m["total"]),
                _size(m["allocated"]),
                _size(m["reserved"]),
                _size(m["kv_bytes"]),
            )
