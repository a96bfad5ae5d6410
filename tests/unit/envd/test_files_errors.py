"""envd's /files error mapping: the client's mistakes are 4xx, only unexpected failures are 500."""

from __future__ import annotations

import errno

import pytest

from aenv.envd.files import _os_error


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (errno.ENOSPC, 507), (errno.EDQUOT, 507), (errno.ENOENT, 404), (errno.EISDIR, 400),
        (errno.EACCES, 403), (errno.EROFS, 403), (errno.EEXIST, 409), (errno.ETXTBSY, 409),
        (errno.EIO, 400),  # writing /proc/self/mem: found by the /files fuzzer
        (errno.ENXIO, 400), (errno.ELOOP, 400), (errno.ENOMEM, 500),
    ],
)  # fmt: skip
def test_os_error_status(code: int, status: int) -> None:
    err = _os_error(OSError(code, "x"), "/p")
    assert err.status == status
    assert "/p" in err.message
