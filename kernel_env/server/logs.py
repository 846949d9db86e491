"""One log format for the server: kernel_env's lines and uvicorn's (errors and access) go
through the same handler, as text or as JSON lines (``--log-format``)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

__all__ = ["HideSignatures", "JsonFormatter", "log_config"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A JSON object per line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class HideSignatures(logging.Filter):
    """Hides the signature of a signed file link (E2B's ``download_url()``) in an access
    line: it is a credential for that file as long as it is valid."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(
            isinstance(a, str) and "signature=" in a for a in record.args
        ):
            record.args = tuple(
                _SIGNATURE.sub(r"\1[hidden]", a) if isinstance(a, str) else a for a in record.args
            )
        return True


_SIGNATURE = re.compile(r"((?:^|[?&])signature=)[^&\s]*")


def log_config(level: str, fmt: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` (what uvicorn's ``log_config`` takes) that sends every
    logger, uvicorn's included, to one stderr handler in the chosen format."""
    formatter: dict[str, Any] = {"()": JsonFormatter} if fmt == "json" else {"format": TEXT_FORMAT}
    one_handler = {"handlers": [], "propagate": True}  # up to the root's handler
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kernel_env": formatter},
        "filters": {"hide_signatures": {"()": HideSignatures}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "kernel_env",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": one_handler,
            "uvicorn.error": one_handler,
            "uvicorn.access": {**one_handler, "filters": ["hide_signatures"]},
        },
    }
