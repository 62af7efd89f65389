"""Logging set-up shared by the services: one line per record, with the current request id.

The request id lives in a context variable, so every log line written while a request is being
handled (in its task) carries it without being passed around.
"""

from __future__ import annotations

import contextvars
import logging

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("tito_request_id", default="-")

LOG_LEVELS = ("debug", "info", "warning", "error")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def setup_logging(level: str = "info", service: str = "tito") -> None:
    """Configure the root logger once: `time level service [request_id] logger: message`."""
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service} [%(request_id)s] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


#: Characters of a caller's request id that go into log lines.
MAX_LOGGED_ID_CHARS = 128


def bind_request_id(request_id: str) -> None:
    """Mark the current task's log lines with `request_id`.

    The id is the caller's: it is escaped (a newline cannot forge a log line) and clipped (a
    megabyte id cannot bloat every line of its request)."""
    if not request_id:
        request_id_var.set("-")
        return
    shown = request_id[:MAX_LOGGED_ID_CHARS].encode("unicode_escape").decode("ascii")
    request_id_var.set(shown if len(request_id) <= MAX_LOGGED_ID_CHARS else shown + "...")
