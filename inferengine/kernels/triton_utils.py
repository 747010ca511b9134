"""Whether Triton kernels can run here, and small launch helpers; never imports Triton itself.

Modules holding `@triton.jit` code (`*_kernels.py`) are imported by the public wrappers on their
first call, so importing a wrapper costs nothing and works where Triton is missing. (Triton
chooses compiler or CPU interpreter when it is imported, so importing it early would also fix
that choice too soon for the kernel tests.)
"""

import functools
import importlib.util

import torch

from inferengine import envs


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when Triton kernels can run here: Triton is installed and there is a CUDA device,
    or the CPU interpreter is on (`TRITON_INTERPRET=1`)."""
    return triton_installed() and (torch.cuda.is_available() or envs.triton_interpret())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter."""
    if device_index is None:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.device.type == "cuda" else None)


@functools.cache
def _sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def hopper_or_later(t: torch.Tensor) -> bool:
    """Whether `t` lives on a CUDA device of compute capability 9.0 or later (TMA, PDL)."""
    return t.is_cuda and _sm90_or_later(t.device.index or 0)


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if envs.triton_interpret() or not envs.use_pdl() or not _sm90_or_later(device_index):
        return False
    try:  # launch_pdl and gdc_wait arrived in Triton 3.3
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda

        return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl_cuda, "gdc_wait")
    except (ImportError, AttributeError):
        return False


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for programmatic dependent launch (Hopper and later): the kernel may
    start while the previous one drains, and waits for its results in `pdl_enter`. Every kernel
    given these keywords must call `pdl_enter(USE_PDL)` before it touches memory."""
    if t.is_cuda and _pdl_supported(t.device.index or 0):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []  # kept alive: captured graphs may point at them


def arrival_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """Zeroed int32 counters for "the last program to arrive finishes the job" reductions;
    kernels leave them zero. Allocated outside graph capture only (None there if too few), one
    set per device shared by all such kernels: they must not run concurrently on two streams."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < count:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        if counters is not None:
            _retired_counters.append(counters)
        counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def tma_ready(t: torch.Tensor, block_rows: int, block_cols: int) -> bool:
    """TMA's rules for a 2-D tensor: 16-byte aligned base and row stride, dense last dim,
    boxes of at most 256 per dim."""
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and t.stride(0) * t.element_size() % 16 == 0
        and max(block_rows, block_cols) <= 256
    )
