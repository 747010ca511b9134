"""Scheduling and KV-page bookkeeping. Pure Python: no torch, no I/O."""
