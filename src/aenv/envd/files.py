"""``GET /files`` and ``POST /files`` (spec §3.4): plain-HTTP download and upload.

Uploads are streamed straight to their destination: the multipart parser
(``python_multipart``) and the file writes run chunk by chunk in a worker
thread, so neither a whole file nor the event loop is held up. Errors are
``{"code": <int>, "message"}`` with the HTTP status the SDK maps to exceptions.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from aenv.envd.auth import SignatureError, validate_files_request
from aenv.envd.entry import METADATA_XATTR_PREFIX
from aenv.envd.errors import EnvdError
from aenv.envd.filesystem import make_dirs
from aenv.envd.identity import SandboxState, User

METADATA_HEADER_PREFIX = "x-metadata-"
MAX_METADATA_KEY = 246
MAX_METADATA_TOTAL = 4096
WHOLE_READ_MAX = 4 * 1024 * 1024  # files up to this size are read whole, then sent
DOWNLOAD_CHUNK = 256 * 1024


class HTTPError(Exception):
    """An error answered as ``{"code": status, "message"}`` on the /files routes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> Response:
    return Response(json.dumps({"code": status, "message": message}), status, media_type="application/json")


_NOT_A_FILE_TARGET = frozenset(
    {errno.EIO, errno.ENXIO, errno.ENODEV, errno.ELOOP, errno.EFBIG, errno.ESPIPE, errno.EOPNOTSUPP}
)


def _os_error(exc: OSError, path: str) -> HTTPError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPError(507, f"not enough disk space to write '{path}'")
    if exc.errno == errno.ENOENT:
        return HTTPError(404, f"path '{path}' does not exist")
    if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EINVAL):
        return HTTPError(400, f"invalid path '{path}': {exc.strerror}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HTTPError(403, f"permission denied for '{path}': {exc.strerror}")
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EBUSY, errno.ETXTBSY):
        return HTTPError(409, f"cannot write '{path}': {exc.strerror}")
    if exc.errno in _NOT_A_FILE_TARGET:
        # Special files (/proc/self/mem, device nodes, sockets) refuse plain writes: the
        # request named something that cannot take a file's content, not a server fault.
        return HTTPError(400, f"'{path}' cannot be written as a file: {exc.strerror}")
    return HTTPError(500, f"error writing '{path}': {exc.strerror or exc}")


def parse_metadata(headers: Any) -> dict[str, str]:
    """``X-Metadata-<Key>`` headers → lower-cased metadata, validated as envd does."""
    meta: dict[str, str] = {}
    for key, value in headers.items():
        if not key.lower().startswith(METADATA_HEADER_PREFIX):
            continue
        name = key[len(METADATA_HEADER_PREFIX) :].lower()
        if not name or len(name.encode()) > MAX_METADATA_KEY or not all(0x21 <= ord(c) <= 0x7E for c in name):
            raise HTTPError(400, f"invalid metadata key '{name}'")
        if not all(0x20 <= ord(c) <= 0x7E for c in value):
            raise HTTPError(400, f"invalid metadata value for key '{name}': only printable ASCII is allowed")
        meta[name] = value
    if sum(len(k) + len(v) for k, v in meta.items()) > MAX_METADATA_TOTAL:
        raise HTTPError(400, f"metadata exceeds {MAX_METADATA_TOTAL} bytes")
    return meta


def apply_metadata(path: str, meta: dict[str, str]) -> None:
    """Replace the ``user.e2b.*`` xattrs of ``path`` with ``meta`` (empty ⇒ clear them)."""
    try:
        existing = [n for n in os.listxattr(path) if n.startswith(METADATA_XATTR_PREFIX)]
    except OSError:
        existing = []
    for name in existing:
        if name[len(METADATA_XATTR_PREFIX) :] not in meta:
            try:
                os.removexattr(path, name)
            except OSError:
                pass
    for key, value in meta.items():
        try:
            os.setxattr(path, METADATA_XATTR_PREFIX + key, value.encode())
        except OSError as exc:
            # EPERM/ENOTSUP: user xattrs exist only on regular files and directories (not on
            # /dev/null, FIFOs) or not on this filesystem: the client's request, not our fault.
            status = 400 if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EROFS) else 500
            raise HTTPError(status, f"cannot store metadata on '{path}': {exc.strerror}") from exc


@dataclass
class UploadTarget:
    """Opens, writes and finishes one destination file."""

    path: str
    user: User
    meta: dict[str, str]
    fd: int = -1

    def open(self) -> None:
        try:
            if os.path.isdir(self.path):
                raise HTTPError(400, f"path '{self.path}' is a directory")
            make_dirs(os.path.dirname(self.path), self.user)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            # Only regular files change owner: writing to /dev/null must not chown the device node
            # (in the ns runtime it is the host's own inode, bind-mounted in).
            if self.user.owns_files() and stat.S_ISREG(os.fstat(self.fd).st_mode):
                os.fchown(self.fd, self.user.uid, self.user.gid)
        except OSError as exc:
            raise _os_error(exc, self.path) from exc

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            raise _os_error(exc, self.path) from exc

    def close(self) -> dict[str, Any]:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        apply_metadata(self.path, self.meta)
        result: dict[str, Any] = {"path": self.path, "name": os.path.basename(self.path), "type": "file"}
        if self.meta:
            result["metadata"] = self.meta
        return result

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class MultipartSink:
    """python_multipart callbacks writing every part named ``file`` to its destination.

    The destination is the ``path`` query parameter or, without it, the part's
    filename taken verbatim as a full path (directories are not stripped).
    """

    boundary: bytes
    state: SandboxState
    user: User
    path_param: str | None
    meta: dict[str, str]
    results: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)
    _headers: dict[str, str] = field(default_factory=dict)
    _field: bytearray = field(default_factory=bytearray)
    _value: bytearray = field(default_factory=bytearray)
    _target: UploadTarget | None = None
    _in_part: bool = False

    def __post_init__(self) -> None:
        self.parser = MultipartParser(
            self.boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": lambda d, s, e: self._field.extend(d[s:e]),
                "on_header_value": lambda d, s, e: self._value.extend(d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise HTTPError(400, f"malformed multipart body: {exc}") from exc

    def finish(self) -> list[dict[str, Any]]:
        try:
            self.parser.finalize()
        except MultipartParseError as exc:
            raise HTTPError(400, f"malformed multipart body: {exc}") from exc
        if self._in_part:
            self.abort()
            raise HTTPError(400, "incomplete multipart body")
        return self.results

    def abort(self) -> None:
        if self._target is not None:
            self._target.abort()
            self._target = None

    def _part_begin(self) -> None:
        self._headers = {}
        self._target = None
        self._in_part = True

    def _header_end(self) -> None:
        self._headers[self._field.decode("latin-1").strip().lower()] = self._value.decode("latin-1").strip()
        self._field.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", ""))
        if options.get(b"name") != b"file":
            return  # other form fields are ignored
        filename = options.get(b"filename", b"").decode("utf-8", "surrogateescape")
        dest = self.path_param if self.path_param else filename
        if not dest:
            raise HTTPError(400, "no destination: pass 'path' or a full path as the part's filename")
        try:
            resolved = self.state.resolve_path(dest, self.user)
        except EnvdError as exc:
            raise HTTPError(400, exc.message) from exc
        if resolved in self._seen:
            raise HTTPError(400, f"path '{resolved}' is written more than once in one request")
        self._seen.add(resolved)
        self._target = UploadTarget(resolved, self.user, self.meta)
        self._target.open()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._target is not None:
            self._target.write(memoryview(data)[start:end])

    def _part_end(self) -> None:
        self._in_part = False
        if self._target is not None:
            self.results.append(self._target.close())
            self._target = None


class FilesRoutes:
    def __init__(self, state: SandboxState) -> None:
        self.state = state

    def _authorize(self, request: Request, operation: str) -> tuple[str, User]:
        """Check token or signature and resolve the user; returns (path param, user)."""
        q = request.query_params
        path_param = q.get("path", "")
        username = q.get("username") or None
        try:
            validate_files_request(
                self.state.access_token,
                request.headers.get("x-access-token"),
                path_param,
                operation,
                username,
                q.get("signature"),
                q.get("signature_expiration"),
            )
        except SignatureError as exc:
            raise HTTPError(401, str(exc)) from exc
        try:
            user = self.state.resolve_user(username)
        except EnvdError as exc:
            raise HTTPError(401, f"error looking up user '{username}': {exc.message}") from exc
        return path_param, user

    def _resolve(self, path_param: str, user: User) -> str:
        try:
            return self.state.resolve_path(path_param, user)
        except EnvdError as exc:
            raise HTTPError(400, exc.message) from exc

    async def get(self, request: Request) -> Response:
        try:
            path_param, user = self._authorize(request, "read")
            path = self._resolve(path_param, user)
            try:
                st = os.stat(path)
            except OSError as exc:
                raise _os_error(exc, path) from exc
            if stat.S_ISDIR(st.st_mode):
                raise HTTPError(400, f"path '{path}' is a directory")
            if not os.access(path, os.R_OK):
                raise HTTPError(403, f"permission denied for '{path}'")
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        try:
            return await download_response(path)
        except OSError as exc:
            err = _os_error(exc, path)
            return error_response(err.status, err.message)

    async def post(self, request: Request) -> Response:
        try:
            path_param, user = self._authorize(request, "write")
            meta = parse_metadata(request.headers)
            ctype, options = parse_options_header(request.headers.get("content-type", ""))
            if ctype == b"multipart/form-data":
                results = await self._multipart(
                    request, options.get(b"boundary"), path_param or None, user, meta
                )
            elif ctype == b"application/octet-stream":
                results = [await self._octet_stream(request, path_param, user, meta)]
            else:
                raise HTTPError(400, f"unsupported content type '{ctype.decode('latin-1')}'")
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        return Response(json.dumps(results), 200, media_type="application/json")

    async def _multipart(
        self,
        request: Request,
        boundary: bytes | None,
        path_param: str | None,
        user: User,
        meta: dict[str, str],
    ) -> list[dict[str, Any]]:
        if not boundary:
            raise HTTPError(400, "multipart body without boundary")
        sink = MultipartSink(boundary, self.state, user, path_param, meta)
        try:
            async for chunk in request.stream():
                if chunk:
                    await anyio.to_thread.run_sync(sink.feed, chunk)
            results = await anyio.to_thread.run_sync(sink.finish)
        finally:
            sink.abort()
        if not results:
            raise HTTPError(400, "no file part named 'file' in the multipart body")
        return results

    async def _octet_stream(
        self, request: Request, path_param: str, user: User, meta: dict[str, str]
    ) -> dict[str, Any]:
        if not path_param:
            raise HTTPError(
                400, "the 'path' query parameter is required for application/octet-stream uploads"
            )
        target = UploadTarget(self._resolve(path_param, user), user, meta)
        gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None

        def write(chunk: bytes) -> None:
            nonlocal inflater
            if inflater is None:
                target.write(chunk)
                return
            try:
                data = inflater.decompress(chunk)
                target.write(data)
                while inflater.unused_data:  # concatenated gzip members
                    rest = inflater.unused_data
                    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    target.write(inflater.decompress(rest))
            except zlib.error as exc:
                raise HTTPError(400, f"invalid gzip body: {exc}") from exc

        await anyio.to_thread.run_sync(target.open)
        try:
            async for chunk in request.stream():
                if chunk:
                    await anyio.to_thread.run_sync(write, chunk)
            if inflater is not None and not inflater.eof:
                raise HTTPError(400, "truncated gzip body")
        except BaseException:
            target.abort()
            raise
        return await anyio.to_thread.run_sync(target.close)


async def download_response(path: str) -> Response:
    """``GET /files``' answer: the file's bytes, with a Content-Length that matches them.

    Another process may rewrite or extend the file while it is read: an agent reads the log a
    command is still writing, and ``echo n > f`` truncates before it writes. A length taken from
    ``stat()`` and a body read afterwards then disagree, and the client sees the connection cut
    mid-body. So a file of up to WHOLE_READ_MAX bytes is read whole first and sent with the length
    read. A larger one is streamed up to the size ``fstat()`` gave when it was opened (what is
    appended later is left out, as E2B's envd does); only a file that shrinks meanwhile still ends
    short."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        data = await anyio.to_thread.run_sync(_read_whole, fd, WHOLE_READ_MAX) if size <= WHOLE_READ_MAX else None
    except BaseException:
        os.close(fd)
        raise
    headers = {"content-disposition": _inline_disposition(os.path.basename(path))}
    if data is not None:
        os.close(fd)
        return Response(data, media_type="application/octet-stream", headers=headers)
    headers["content-length"] = str(size)
    return StreamingResponse(_stream_prefix(fd, size), media_type="application/octet-stream", headers=headers)


def _read_whole(fd: int, limit: int) -> bytes | None:
    """Everything up to EOF, or None once it exceeds ``limit`` (the file grew past it)."""
    parts, total = [], 0
    while chunk := os.read(fd, DOWNLOAD_CHUNK):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            os.lseek(fd, 0, os.SEEK_SET)
            return None
    return b"".join(parts)


async def _stream_prefix(fd: int, size: int) -> AsyncIterator[bytes]:
    """The first ``size`` bytes of ``fd`` in chunks read off the event loop; closes ``fd``."""
    try:
        left = size
        while left > 0:
            chunk = await anyio.to_thread.run_sync(os.read, fd, min(DOWNLOAD_CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


def _inline_disposition(name: str) -> str:
    quoted = quote(name)
    return f"inline; filename*=utf-8''{quoted}" if quoted != name else f'inline; filename="{name}"'
