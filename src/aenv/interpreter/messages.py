"""Jupyter iopub messages → the NDJSON lines ``e2b-code-interpreter`` parses (spec §4). Pure functions.

Why a separate module: the mapping is the whole protocol contract with the SDK, and it can be tested on
the host without a kernel. Every line is a plain dict; ``service`` serialises it.
"""

from __future__ import annotations

import time
from typing import Any

Line = dict[str, Any]

# MIME type → field of the SDK's ``Result``. Anything else goes to ``extra`` (the SDK keeps it verbatim).
MIME_FIELDS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    # the kernel's own formatters (``display.py``): a DataFrame's columns, a matplotlib figure's chart
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def timestamp() -> int:
    """Nanoseconds since the epoch: what the SDK stores in ``OutputMessage.timestamp``."""
    return time.time_ns()


def stream_line(name: str, text: str) -> Line:
    """A ``stdout``/``stderr`` line; any other stream name counts as stdout."""
    return {"type": "stderr" if name == "stderr" else "stdout", "text": text, "timestamp": timestamp()}


def result_line(bundle: dict[str, Any], *, is_main_result: bool) -> Line:
    """A ``result`` line from a MIME bundle. Images stay base64 (Jupyter already sends them that way)."""
    line: Line = {"type": "result", "is_main_result": is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
            continue
        if isinstance(value, list) and field != "json":  # nbformat allows multiline strings as lists
            value = "".join(str(v) for v in value)
        if field in ("png", "jpeg") and isinstance(value, str):
            value = value.replace("\n", "")
        if field == "text" and isinstance(value, str):
            value = unquote(value)
        line[field] = value
    if extra:
        line["extra"] = extra
    return line


def unquote(text: str) -> str:
    """A string's repr shown as the string, as E2B's service does (``os.getenv('X')`` → ``bar``, not
    ``'bar'``): one pair of matching outer quotes goes."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def error_line(name: str, value: str, traceback: list[str] | str) -> Line:
    """An ``error`` line; the SDK wants the traceback as one string."""
    tb = traceback if isinstance(traceback, str) else "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": tb}


def count_line(execution_count: int) -> Line:
    return {"type": "number_of_executions", "execution_count": execution_count}


END: Line = {"type": "end_of_execution"}
UNEXPECTED_END: Line = {"type": "unexpected_end_of_execution"}
KEEPALIVE: Line = {"type": "keepalive"}


def iopub_to_lines(msg: dict[str, Any]) -> list[Line]:
    """Lines for one iopub message of the running request (the caller filters by parent ``msg_id``).

    ``status`` and unknown types give no line: the caller watches ``status: idle`` itself to know when
    the request is done.
    """
    kind = msg.get("header", {}).get("msg_type") or msg.get("msg_type")
    content: dict[str, Any] = msg.get("content", {})
    if kind == "stream":
        return [stream_line(str(content.get("name", "stdout")), str(content.get("text", "")))]
    if kind == "execute_result":
        return [result_line(content.get("data", {}), is_main_result=True)]
    if kind == "display_data":
        return [result_line(content.get("data", {}), is_main_result=False)]
    if kind == "error":
        return [
            error_line(
                str(content.get("ename", "")), str(content.get("evalue", "")), content.get("traceback", [])
            )
        ]
    if kind == "execute_input" and isinstance(content.get("execution_count"), int):
        return [count_line(content["execution_count"])]
    return []
