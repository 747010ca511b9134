"""The entry every kernel launched with `triton_utils.pdl_launch` calls first."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.3: triton_utils.pdl_launch never turns USE_PDL on there
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch:
    its programs start on SMs as this one's last wave frees them, up to their own wait."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
