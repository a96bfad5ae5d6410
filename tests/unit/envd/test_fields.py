"""proto3-JSON request accessors."""

from __future__ import annotations

import pytest

from aenv.envd.errors import InvalidArgument
from aenv.envd.fields import get_bool, get_bytes, get_enum, get_int, get_str_list, get_str_map, has


def test_camel_and_snake_names() -> None:
    assert get_str_map({"envs": {"A": "1"}}, "envs") == {"A": "1"}
    assert get_bool({"include_entry": True}, "includeEntry") is True
    assert has({"watcher_id": "w1"}, "watcherId")


def test_int_accepts_numbers_and_strings() -> None:
    assert get_int({"pid": 5}, "pid") == 5
    assert get_int({"pid": "7"}, "pid") == 7
    assert get_int({}, "pid") == 0
    for bad in (True, "x", [1]):
        with pytest.raises(InvalidArgument):
            get_int({"pid": bad}, "pid")


def test_bytes_base64_std_and_url() -> None:
    assert get_bytes({"stdin": "YWJj"}, "stdin") == b"abc"
    assert get_bytes({"stdin": "YQ"}, "stdin") == b"a"
    assert get_bytes({"stdin": "-_8="}, "stdin") == b"\xfb\xff"
    with pytest.raises(InvalidArgument):
        get_bytes({"stdin": "***"}, "stdin")


def test_enum_names_and_numbers() -> None:
    values = {"SIGNAL_SIGKILL": 9}
    assert get_enum({"signal": "SIGNAL_SIGKILL"}, "signal", values) == 9
    assert get_enum({"signal": 15}, "signal", values) == 15
    with pytest.raises(InvalidArgument):
        get_enum({"signal": "SIGHUP"}, "signal", values)


def test_list_type_checked() -> None:
    assert get_str_list({"args": ["-c", "x"]}, "args") == ["-c", "x"]
    with pytest.raises(InvalidArgument):
        get_str_list({"args": "x"}, "args")
