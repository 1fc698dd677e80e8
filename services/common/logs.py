"""Structured logs: one JSON object per line (or plain text with GPUPLANE_LOG_FORMAT=text).

Extra fields go in `extra={...}` and land as top-level keys, so a log query can filter on
`zone`, `worker_id` or `key` without parsing the message.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger once per process for `service`."""
    level = level or os.environ.get("GPUPLANE_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("GPUPLANE_LOG_FORMAT", "json") == "text":
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
