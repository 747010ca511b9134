"""Triton kernels, each with a torch reference function beside it.

Public wrappers and references: `paged_attention`, `kv_store`, `norm`, `rotary`, `activation`;
`triton_utils.triton_available()` says whether the kernels can run. The `@triton.jit` code lives in
`attention_kernels` and `fused_kernels`, imported on a wrapper's first call.
"""
