"""Root-cause material of a dead rank: its error file, traceback and stderr tail."""

from __future__ import annotations

import json
from pathlib import Path

TRACEBACK_HEAD = "Traceback (most recent call last):"


def tail(path: Path, max_bytes: int = 8192) -> str:
    """The last ``max_bytes`` of a file as text ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def error_file_traceback(path: Path) -> str:
    """The traceback a rank wrote to its TORCHELASTIC_ERROR_FILE, or ''.

    The format is torch.distributed.elastic's: ``{"message": {"message": ...,
    "extraInfo": {"py_callstack": ...}}}``; a plain string message is taken as is.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return ""
    message = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return stack or str(message.get("message", ""))
    return str(message)


def stderr_traceback(stderr_tail: str) -> str:
    """The last Python traceback in a stderr tail, through to the end, or ''."""
    at = stderr_tail.rfind(TRACEBACK_HEAD)
    return stderr_tail[at:].rstrip() if at >= 0 else ""
