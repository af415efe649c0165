"""Structured logs for every Keel process (controller, agent, trainer ranks): one
structlog pipeline on stderr, as JSON lines or as text for a terminal, which the stdlib
``logging`` of gRPC and etcd3 goes through too (torch's loggers keep their own handlers
and do not propagate)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

from common import env

FORMATS = ("json", "console")
LEVELS = ("debug", "info", "warning", "error")


class _Stderr:
    """``sys.stderr`` as it is when each line is written, so that logs follow one that
    was swapped after ``configure`` (pytest's capture, a training script's wrapper)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def settings(fmt: str | None = None, level: str | None = None, *, tty: bool) -> tuple[str, str]:
    """The log format and level to use: ``fmt`` and ``level`` when given (the flags),
    else ``KEEL_LOG_FORMAT`` and ``KEEL_LOG_LEVEL`` (a deployment's override), else
    ``console`` if the logs go to a terminal (``tty``) and ``json`` if not, and
    ``info``. Raises ValueError naming the choices."""
    fmt = fmt or os.environ.get(env.LOG_FORMAT) or ("console" if tty else "json")
    level = level or os.environ.get(env.LOG_LEVEL) or "info"
    if fmt not in FORMATS:
        raise ValueError(
            f"log format {fmt!r}: give --log-format (or {env.LOG_FORMAT}) {' or '.join(FORMATS)}"
        )
    if level not in LEVELS:
        raise ValueError(
            f"log level {level!r}: give --log-level (or {env.LOG_LEVEL}) one of {', '.join(LEVELS)}"
        )
    return fmt, level


def configure(
    component: str,
    *,
    fmt: str | None = None,
    level: str | None = None,
    stream: TextIO | None = None,
    **context: object,
) -> None:
    """Sends this process's logs to ``stream`` (default: ``sys.stderr``, as it is at
    each line): with ``fmt`` "json" one object per line, "console" structlog's
    ``ConsoleRenderer`` (coloured only on a terminal); lines below ``level`` (debug,
    info, warning, error) are dropped. Format and level resolve as ``settings`` says:
    argument (flag) > ``KEEL_LOG_FORMAT``/``KEEL_LOG_LEVEL`` > console on a terminal,
    else json; info.

    Every line carries an ISO-8601 UTC ``timestamp``, ``level``, ``event``,
    ``component`` and ``context`` (``job``, ``generation``, ``node``, ``rank``: those
    that apply), from every thread, plus any bound contextvars; a call's own fields win.
    The root stdlib logger, which gRPC's and etcd3's loggers propagate to, gets
    one handler rendering its records the same way at the same level (with a ``logger``
    field), in place of any earlier one of ours. Uncaught exceptions are left to Python:
    their traceback stays plain text on stderr. Raises ValueError for a bad format or
    level. Safe to call again: loggers are not cached, so the newest call wins."""
    stream = stream or _Stderr()
    fmt, level = settings(fmt, level, tty=stream.isatty())
    fields = {"component": component, **context}

    def add_context(_logger, _method: str, event: dict) -> dict:
        return {**fields, **event}

    shared = [
        structlog.contextvars.merge_contextvars,
        add_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    render = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    )
    threshold = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[*shared, *render],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    for earlier in [
        h for h in root.handlers if isinstance(h.formatter, structlog.stdlib.ProcessorFormatter)
    ]:
        root.removeHandler(earlier)
    root.addHandler(handler)
    root.setLevel(threshold)
