"""Structured JSON logs, one object per line on stderr."""

import sys

import structlog


def configure(component: str, **context: str) -> None:
    """Log JSON lines to stderr carrying ``component`` and ``context`` on every line."""
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars,
                    structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)
    structlog.contextvars.bind_contextvars(component=component, **context)
