"""One-line error text for reports (bench, accuracy, call_overhead): the type and the first line."""

from __future__ import annotations


def short_error(e: BaseException, limit: int = 300) -> str:
    """'Type: first line of the message', cut to `limit` characters (ending in '...' when cut)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
