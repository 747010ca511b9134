"""Data parallelism: engine replicas placed by Ray behind one endpoint and a cache-aware router.

`router.Router` decides (pure Python); `replica.EngineReplica` is the Ray actor around one
engine core; `client.DPClient` speaks the engine-core client protocol over the replicas (routing,
failover, stats); `llm.DataParallelLLM` is the `AsyncLLM` the server builds for
`--data-parallel-size N`.
"""
