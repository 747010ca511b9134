"""The GPU's device-to-device copy bandwidth, measured in the run it is compared with."""

from __future__ import annotations


def copy_bandwidth_gbps(size_bytes: int = 2 << 30, repeats: int = 10) -> float | None:
    """Median GB/s of a large device copy, counting bytes read and written; None without CUDA.

    Decode reads every weight once per step, so weight bytes / this rate is the floor of a
    decode step's time.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    times.sort()
    return 2 * size_bytes / times[len(times) // 2] / 1e9
