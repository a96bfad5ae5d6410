"""Errors raised by ``AenvClient``. The whole tree::

    AenvClientError
    ├── ServerUnreachable       the server could not be reached (connection or timeout)
    └── ApiError                the server answered with an error status (.status, .message, .response)
        ├── NotFoundError       404: no such sandbox or snapshot
        │   └── GoneError       410: it existed and ended (a lease; a sandbox when asked with Prefer)
        └── ConflictError       409: not possible in this state (e.g. a full snapshot the runtime
                                cannot take, deleting a snapshot in use, rollback outside the lineage)
"""

from __future__ import annotations

import httpx


class AenvClientError(Exception):
    pass


class ServerUnreachable(AenvClientError):
    pass


class ApiError(AenvClientError):
    def __init__(self, status: int, message: str, response: httpx.Response | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.response = response


class NotFoundError(ApiError):
    pass


class GoneError(NotFoundError):
    pass


class ConflictError(ApiError):
    pass


def error_for(resp: httpx.Response) -> ApiError:
    try:
        body = resp.json()
        message = str(body.get("message", resp.text)) if isinstance(body, dict) else resp.text
    except ValueError:
        message = resp.text or resp.reason_phrase
    cls = {404: NotFoundError, 409: ConflictError, 410: GoneError}.get(resp.status_code, ApiError)
    return cls(resp.status_code, message, resp)
