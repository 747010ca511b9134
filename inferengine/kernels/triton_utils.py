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
