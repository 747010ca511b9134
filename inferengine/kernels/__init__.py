"""Triton kernels, each with a torch reference function beside it."""
