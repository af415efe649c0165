"""The ``keel`` command line: ``main`` is its entry point (``python -m orchestrator.cli``)."""

from orchestrator.cli.main import main

__all__ = ["main"]
