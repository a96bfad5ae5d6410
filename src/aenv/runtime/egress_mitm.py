"""The egress proxy's header rules in action: one sandbox connection to a rule domain, HTTP or TLS.

TLS is terminated with a leaf for the name the sandbox asked for (``egress_ca.py``), but only after
the real server was reached over TLS verified against the system's CAs (and the operator's extra
bundle): a server that fails verification gets no request, and the sandbox's handshake is cut. Only
``http/1.1`` is offered by ALPN, both ways. Requests are parsed with h11, one fresh parser per request
(h11 waits for a response before it parses the next one; the responses are relayed as bytes, not
parsed), each rewritten with the rule's headers (secrets filled in per request, so an update applies
at once) and re-framed; bodies stream both ways. An upgrade (WebSocket) or CONNECT request is rewritten,
then the connection is relayed as bytes. No value is ever logged.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence

import h11

from aenv.errors import StoreUnavailable
from aenv.runtime import egress_rules
from aenv.runtime.egress_ca import EgressCa
from aenv.runtime.egress_own import refusal
from aenv.runtime.egress_rules import HeaderRule, UnresolvedSecret

log = logging.getLogger("aenv.egress")

_CHUNK = 65536
_MAX_HEAD = 64 * 1024
_CONNECT_TIMEOUT = 10.0


class _Side:
    """The sandbox's end of the connection, bytes already read first."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes) -> None:
        self.reader, self.writer, self.first = reader, writer, first

    async def read(self) -> bytes:
        if self.first:
            data, self.first = self.first, b""
            return data
        return await self.reader.read(_CHUNK)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def write_eof(self) -> None:
        if self.writer.can_write_eof():
            self.writer.write_eof()


class _TlsSide(_Side):
    """The sandbox's end as a TLS server (memory BIOs: the ClientHello was already read to sniff SNI)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes,
                 ctx: ssl.SSLContext) -> None:
        super().__init__(reader, writer, b"")
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=True)
        self._in.write(first)

    async def _flush(self) -> None:
        if data := self._out.read():
            self.writer.write(data)
            await self.writer.drain()

    async def _fill(self) -> bool:
        chunk = await self.reader.read(_CHUNK)
        if chunk:
            self._in.write(chunk)
        else:
            self._in.write_eof()
        return bool(chunk)

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("the sandbox ended the TLS handshake") from None
        await self._flush()

    async def read(self) -> bytes:
        eof = False
        while True:
            try:
                return self._tls.read(_CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                if eof:  # a record cut short by the end of the connection
                    return b""
                eof = not await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    async def write_eof(self) -> None:
        try:
            self._tls.unwrap()
        except ssl.SSLError:
            pass
        await self._flush()


def _refused(status: int, reason: str, why: str) -> bytes:
    body = f"aenv egress proxy: {why}\n".encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body))  # fmt: skip


def _bad_gateway(why: str) -> bytes:
    return _refused(502, "Bad Gateway", why)


def _rewritten(req: h11.Request, host: str, add: Sequence[tuple[bytes, bytes]]) -> h11.Request:
    headers = egress_rules.rewrite(req.headers.raw_items(), add)
    names = {n.lower() for n, _ in headers}
    if b"host" not in names:  # an HTTP/1.0 request may lack one; HTTP/1.1 (what goes out) may not
        headers.insert(0, (b"Host", host.encode()))
    if req.http_version == b"1.0" and b"connection" not in names:
        headers.append((b"Connection", b"close"))  # 1.0 without keep-alive: the exchange ends the connection
    return h11.Request(method=req.method, target=req.target, headers=headers)


async def _requests(key: str, client: _Side, up: asyncio.StreamWriter, host: str,
                    headers_for: Callable[[], list[tuple[bytes, bytes]]], pinned: int | None = None) -> None:
    """Client -> upstream: each request rewritten; at an upgrade, the rest as bytes. ``pinned``: each
    request checked by ``egress_own.refusal`` first."""
    pending = b""
    while True:
        them = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        out = h11.Connection(h11.CLIENT)
        if pending:  # (an empty receive_data is h11's end of input)
            them.receive_data(pending)
        raw_after = False
        while True:
            event = them.next_event()
            if event is h11.NEED_DATA:
                data = await client.read()
                if not data and them.their_state is h11.IDLE and not them.trailing_data[0]:
                    if up.can_write_eof():
                        up.write_eof()
                    return
                them.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                if pinned is not None and (why := refusal(event.method, event.target, event.headers.raw_items(),
                                                          host, pinned)):
                    log.info("sandbox=%s egress to %s refused: %s", key, host, why)
                    await client.write(_refused(421, "Misdirected Request", why))
                    raise ConnectionAbortedError from None
                try:
                    add = await asyncio.to_thread(headers_for)  # a store read (cluster: Redis): off the loop
                except UnresolvedSecret as exc:
                    log.warning("sandbox=%s egress to %s refused: the secret '%s' of its rules no longer exists",
                                key, host, exc)
                    await client.write(_bad_gateway(f"the secret '{exc}' of this sandbox's network rules no longer exists"))
                    raise ConnectionAbortedError from None
                except StoreUnavailable as exc:  # cluster mode: the secrets' Redis did not answer; nothing sent
                    log.warning("sandbox=%s egress to %s refused: %s", key, host, exc)
                    await client.write(_refused(503, "Service Unavailable", "the secrets of this sandbox's network "
                                                "rules cannot be read now (the cluster's store did not answer)"))
                    raise ConnectionAbortedError from None
                upgrade = event.method == b"CONNECT" or any(n.lower() == b"upgrade" for n, _ in event.headers.raw_items())
                raw_after = raw_after or upgrade
                up.write(out.send(_rewritten(event, host, add)))
            elif isinstance(event, h11.Data):
                up.write(out.send(event))
                await up.drain()
            elif isinstance(event, h11.EndOfMessage):
                up.write(out.send(event))
                await up.drain()
                pending = them.trailing_data[0]
                break
            else:  # ConnectionClosed, or PAUSED
                return
        if raw_after:
            if pending:
                up.write(pending)
            while data := await client.read():
                up.write(data)
                await up.drain()
            if up.can_write_eof():
                up.write_eof()
            return


async def _responses(up: asyncio.StreamReader, client: _Side) -> None:
    while data := await up.read(_CHUNK):
        await client.write(data)
    await client.write_eof()


async def intercept(key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes, *,
                    host: str, target: str, port: int, rules: Sequence[HeaderRule], tls: bool,
                    ca: EgressCa | None, upstream_ssl: ssl.SSLContext | None,
                    lookup: Callable[[str], str | None], upstream_tls: bool | None = None,
                    pinned: int | None = None) -> None:
    """Serve one sandbox connection to ``host`` (a rule domain) at ``target``:``port``. ``upstream_tls``:
    whether the upstream speaks TLS (default: as the sandbox does). ``pinned``: every request must name
    ``host`` (on this port) as its Host (``egress_own.refusal``), else 421 and the connection ends."""
    up_tls = tls if upstream_tls is None else upstream_tls
    if (tls and ca is None) or (up_tls and upstream_ssl is None):
        return
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            up_reader, up_writer = await asyncio.open_connection(
                target, port, ssl=upstream_ssl if up_tls else None, server_hostname=host if up_tls else None)
    except ssl.SSLCertVerificationError as exc:
        log.warning("sandbox=%s egress to %s (%s:%d) refused: its certificate does not verify (%s)",
                    key, host, target, port, exc.verify_message)
        return
    except (OSError, TimeoutError, ssl.SSLError) as exc:
        log.info("sandbox=%s egress to %s (%s:%d) failed: %r", key, host, target, port, exc)
        return
    try:
        if tls:
            assert ca is not None
            ctx = await asyncio.to_thread(ca.server_context, host)
            client: _Side = _TlsSide(reader, writer, first, ctx)
            async with asyncio.timeout(_CONNECT_TIMEOUT):
                await client.handshake()  # type: ignore[attr-defined]
        else:
            client = _Side(reader, writer, first)
        log.debug("sandbox=%s egress to %s:%d: header rules applied", key, host, port)
        requests = asyncio.ensure_future(_requests(key, client, up_writer, host,
                                                   lambda: egress_rules.resolve(rules, lookup), pinned))
        responses = asyncio.ensure_future(_responses(up_reader, client))
        try:
            # the sandbox done sending: the answers still come; the server done (or a refusal): the end
            await asyncio.wait([requests, responses], return_when=asyncio.FIRST_COMPLETED)
            if requests.done() and not requests.cancelled() and requests.exception() is None:
                await responses
        finally:
            for t in (requests, responses):
                t.cancel()
            await asyncio.gather(requests, responses, return_exceptions=True)
    except (ConnectionError, OSError, TimeoutError, ssl.SSLError, h11.ProtocolError) as exc:
        log.debug("sandbox=%s egress to %s ended: %r", key, host, exc)
    finally:
        up_writer.close()
