"""Runs the worker(s): one in-process, or one process per GPU for tensor parallelism."""
