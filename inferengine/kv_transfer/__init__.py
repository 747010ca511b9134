"""Disaggregated prefill/decode: one engine prefills a prompt, another fetches its KV pages and decodes.

The pieces: `core/kv_connector.py` (the scheduler's half: which pages to publish, hold or fetch;
the `WAITING_FOR_REMOTE_KV` status), `worker/kv_connector.py` (the worker's half: starts fetches
and publishes, polls, times out), and here the transports behind one `KVTransport` protocol
(`base.py`): `NixlConnector` (`nixl.py`, NIXL over UCX: the consumer reads the producer's
registered KV cache directly) and `SharedMemoryConnector` (`shm.py`, page files in /dev/shm on
one host). `--kv-transfer-config '{"kv_role": ..., "kv_connector": ...}'` turns it on.

The HTTP contract (as vLLM's NixlConnector; the `inferengine router` relies on these keys):

- `/v1/completions` and `/v1/chat/completions` take a body field `kv_transfer_params`
  (object or null). Without it a request behaves as on any engine.
- Router -> producer: the client's body with `max_tokens: 1`, `stream: false` and
  `"kv_transfer_params": {"do_remote_decode": true}`. The producer prefills, samples one token,
  finishes, keeps the prompt's full pages for a consumer, and its JSON reply carries a top-level
  `"kv_transfer_params"`:

      {"do_remote_prefill": true, "do_remote_decode": false,
       "remote_engine_id": str, "remote_request_id": str, "remote_block_ids": [int, ...],
       "remote_host": str, "remote_port": int | null, "num_tokens": int, "block_size": int,
       "expires_at": float (unix seconds: the producer frees the pages then),
       "transport": "NixlConnector" | "SharedMemoryConnector", "kv_layout": [...],
       ...the transport's own keys (nixl_*, shm_path)}

  (`{"do_remote_prefill": false, "error": str}` when the pages could not be published: the
  consumer then computes the prompt.)
- Router -> consumer: the client's body (its own `stream`, `max_tokens`) plus that dict as
  `kv_transfer_params`, copied unchanged. The consumer fetches the producer's pages of the
  prompt's full pages except the last one it needs (it computes 1 to block_size prompt tokens
  itself: the last token must produce logits), then decodes. A fetch that fails or times out
  (`kv_load_timeout_s`, or the producer's `expires_at`) is logged and counted
  (`inferengine:kv_transfer_fallback_total`), and the prompt is computed: the request succeeds.
- The producer frees the held pages when the consumer says it has them, or after
  `kv_hold_timeout_s` (default 60 s).
"""

from __future__ import annotations

# The keys of the params a producer's reply carries, which the router copies as they are.
PRODUCER_PARAMS_KEYS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "num_tokens",
    "block_size",
    "expires_at",
    "transport",
)
