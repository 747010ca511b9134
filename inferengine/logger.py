"""The package logger: one format, level from `INFERENGINE_LOG_LEVEL`."""

from __future__ import annotations

import logging
import sys

from inferengine import envs

_ROOT = "inferengine"
_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger(_ROOT)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(envs.log_level())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
