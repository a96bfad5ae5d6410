"""iopub → NDJSON line mapping (spec §4), without a kernel."""

from __future__ import annotations

from aenv.interpreter import messages as m
from aenv.interpreter.kernels import env_prelude


def _msg(kind: str, **content: object) -> dict[str, object]:
    return {"header": {"msg_type": kind}, "content": content}


def test_stream_maps_to_stdout_and_stderr() -> None:
    out = m.iopub_to_lines(_msg("stream", name="stdout", text="hi\n"))
    err = m.iopub_to_lines(_msg("stream", name="stderr", text="bad\n"))
    assert out[0]["type"] == "stdout" and out[0]["text"] == "hi\n" and isinstance(out[0]["timestamp"], int)
    assert err[0]["type"] == "stderr"


def test_execute_result_is_main_and_display_data_is_not() -> None:
    bundle = {
        "text/plain": "2",
        "text/html": "<b>2</b>",
        "image/png": "iVBO\nRw==\n",
        "application/x-custom": {"a": 1},
    }
    main = m.iopub_to_lines(_msg("execute_result", data=bundle, execution_count=3))[0]
    side = m.iopub_to_lines(_msg("display_data", data={"image/svg+xml": ["<svg>", "</svg>"]}))[0]
    assert main == {
        "type": "result",
        "is_main_result": True,
        "text": "2",
        "html": "<b>2</b>",
        "png": "iVBORw==",
        "extra": {"application/x-custom": {"a": 1}},
    }
    assert side == {"type": "result", "is_main_result": False, "svg": "<svg></svg>"}


def test_json_mime_keeps_its_structure() -> None:
    line = m.result_line({"application/json": {"k": [1, 2]}}, is_main_result=True)
    assert line["json"] == {"k": [1, 2]}


def test_error_joins_the_traceback() -> None:
    line = m.iopub_to_lines(
        _msg("error", ename="ZeroDivisionError", evalue="division by zero", traceback=["a", "b"])
    )
    assert line == [
        {"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "a\nb"}
    ]


def test_execute_input_gives_the_count_and_status_nothing() -> None:
    assert m.iopub_to_lines(_msg("execute_input", code="x", execution_count=7)) == [
        {"type": "number_of_executions", "execution_count": 7}
    ]
    assert m.iopub_to_lines(_msg("status", execution_state="busy")) == []
    assert m.iopub_to_lines(_msg("comm_open")) == []


def test_env_prelude_sets_and_restores() -> None:
    import os

    before, after = env_prelude({"KEEP": "1"}, {"TEMP": "x", "HOME": "/elsewhere"})
    ns: dict[str, object] = {}
    home = os.environ.get("HOME")
    try:
        exec(before, ns)  # noqa: S102 - the snippet is what the kernel runs
        assert os.environ["TEMP"] == "x" and os.environ["KEEP"] == "1" and os.environ["HOME"] == "/elsewhere"
        exec(after, ns)  # noqa: S102
        assert "TEMP" not in os.environ and os.environ.get("HOME") == home and os.environ["KEEP"] == "1"
    finally:
        os.environ.pop("KEEP", None)
        os.environ.pop("TEMP", None)
        if home is not None:
            os.environ["HOME"] = home


def test_a_string_result_shows_without_its_repr_quotes() -> None:
    """E2B's service shows ``os.getenv('X')`` as ``bar``; other reprs stay as they are."""
    for shown, text in (("'bar'", "bar"), ('"it\'s"', "it's"), ("('a', 'b')", "('a', 'b')"), ("'", "'"), ("2", "2")):
        assert m.result_line({"text/plain": shown}, is_main_result=True)["text"] == text


def test_the_kernels_own_formats_become_data_and_chart() -> None:
    line = m.result_line({"text/plain": "df", "e2b/data": {"a": [1, 2]}, "e2b/chart": {"type": "line"}},
                         is_main_result=True)  # fmt: skip
    assert line["data"] == {"a": [1, 2]} and line["chart"] == {"type": "line"} and "extra" not in line
