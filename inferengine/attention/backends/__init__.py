"""Attention backends: `torch` (reference), `triton`, `flex`."""
