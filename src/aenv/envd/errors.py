"""Errors raised by envd handlers, and their Connect codes.

Handlers raise these; only the edge (``connect.py`` for RPC, ``files.py`` for
plain HTTP) turns them into wire responses, so no handler knows about HTTP.

    EnvdError                       code "unknown"       HTTP 500
    ├── Canceled                    "canceled"           499
    ├── InvalidArgument             "invalid_argument"   400
    ├── DeadlineExceeded            "deadline_exceeded"  504
    ├── NotFound                    "not_found"          404
    ├── AlreadyExists               "already_exists"     409
    ├── PermissionDenied            "permission_denied"  403
    ├── ResourceExhausted           "resource_exhausted" 429
    ├── FailedPrecondition          "failed_precondition" 400
    ├── Unimplemented               "unimplemented"      501
    ├── Internal                    "internal"           500
    ├── Unavailable                 "unavailable"        503
    └── Unauthenticated             "unauthenticated"    401
"""

from __future__ import annotations

import errno


class EnvdError(Exception):
    """Root of every error a handler may raise on purpose."""

    code = "unknown"
    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class Canceled(EnvdError):
    code, http_status = "canceled", 499


class InvalidArgument(EnvdError):
    code, http_status = "invalid_argument", 400


class DeadlineExceeded(EnvdError):
    code, http_status = "deadline_exceeded", 504


class NotFound(EnvdError):
    code, http_status = "not_found", 404


class AlreadyExists(EnvdError):
    code, http_status = "already_exists", 409


class PermissionDenied(EnvdError):
    code, http_status = "permission_denied", 403


class ResourceExhausted(EnvdError):
    code, http_status = "resource_exhausted", 429


class FailedPrecondition(EnvdError):
    code, http_status = "failed_precondition", 400


class Unimplemented(EnvdError):
    code, http_status = "unimplemented", 501


class Internal(EnvdError):
    code, http_status = "internal", 500


class Unavailable(EnvdError):
    code, http_status = "unavailable", 503


class Unauthenticated(EnvdError):
    code, http_status = "unauthenticated", 401


def from_os_error(exc: OSError, what: str) -> EnvdError:
    """Translate an ``OSError`` about ``what`` (usually a path) into the matching EnvdError.

    Filesystem handlers call this at one seam so an errno never leaks as a 500.
    """
    detail = f"{what}: {exc.strerror or exc}"
    if exc.errno == errno.ENOENT:
        return NotFound(f"no such file or directory: {what}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"permission denied: {detail}")
    if exc.errno == errno.EEXIST:
        return AlreadyExists(f"already exists: {what}")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EINVAL, errno.ENAMETOOLONG):
        return InvalidArgument(detail)
    if exc.errno == errno.ELOOP:
        return FailedPrecondition(f"symlink loop: {detail}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"not enough space: {detail}")
    return Internal(detail)
