"""The choice of a `KVTransport`: the one `kv_transfer_config` names, or the best that loads."""

from __future__ import annotations

import torch

from inferengine.config import KVTransferConfig
from inferengine.errors import ConfigError
from inferengine.kv_transfer.base import KVTransport
from inferengine.logger import init_logger

logger = init_logger(__name__)


def make_transport(
    config: KVTransferConfig, kv_caches: list[torch.Tensor], block_size: int
) -> KVTransport:
    """`config.kv_connector`'s transport; when it is left out, NIXL if it loads, else shared
    memory (logged either way)."""
    assert config.engine_id is not None
    choice = config.kv_connector
    if choice in (None, "NixlConnector"):
        try:
            from inferengine.kv_transfer.nixl import NixlTransport

            transport: KVTransport = NixlTransport(kv_caches, config.engine_id)
        except Exception as e:  # not installed, or no UCX backend here
            if choice is not None:
                raise ConfigError(
                    f"kv_connector NixlConnector: NIXL does not load here ({e}); install it with "
                    'pip install "inferengine[nixl]", or use "SharedMemoryConnector" on one host.'
                ) from e
            logger.info("KV transfer: NIXL does not load (%s); using SharedMemoryConnector", e)
        else:
            logger.info("KV transfer: %s, engine id %s", transport.name, config.engine_id)
            return transport
    from inferengine.kv_transfer.shm import SharedMemoryTransport

    transport = SharedMemoryTransport(
        kv_caches, config.engine_id, config.kv_buffer_dir, config.kv_hold_timeout_s
    )
    logger.info(
        "KV transfer: SharedMemoryConnector in %s, engine id %s",
        config.kv_buffer_dir,
        config.engine_id,
    )
    return transport
