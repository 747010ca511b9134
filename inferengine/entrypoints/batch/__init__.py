"""`inferengine run-batch`: offline batch files (OpenAI Batch JSONL, JSONL, CSV, Parquet) in-process."""

from inferengine.entrypoints.batch.runner import BatchConfig, BatchSummary, run_batch

__all__ = ["BatchConfig", "BatchSummary", "run_batch"]
