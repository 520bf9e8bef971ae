"""The load generator's HTTP/1.1 client, whose every read is stamped twice: when the client's
event loop read the bytes, and when they reached this machine's kernel (`SO_TIMESTAMPNS`).

On a machine it shares with the server, a load generator busy with thousands of streams reads
each chunk late by however long its own loop was busy, and a gap measured at the read carries
that lag. The kernel's receive time does not: it is when the server's bytes arrived, what a
client on a machine of its own would see. Where the loop fell behind by a whole chunk interval
the kernel has merged the chunks waiting in the socket and gives them the later arrival, so a
gap measured this way can only read long, never short.

Pure Python on purpose (no C parser): the reads are driven by a reader callback that parses in
place, without waking a task per chunk, and only the response's end wakes its caller.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python names it from 3.13 on
_STAMP = struct.Struct("qq")  # struct timespec: seconds, nanoseconds (CLOCK_REALTIME)
_ANC_SIZE = socket.CMSG_SPACE(_STAMP.size)
READ_SIZE = 65536

# (body bytes, when the loop read them, when the kernel received them): perf_counter seconds
OnBody = Callable[[bytes, float, float], None]
OnHead = Callable[["Head", float, float], None]  # (the head, when the loop read it, when it arrived)


def arrival(ancdata: list[tuple[int, int, bytes]], now: float, wall_now: float) -> float:
    """The kernel's receive time of a read's bytes on the perf_counter timeline of `now` (read at
    wall time `wall_now`); `now` when the socket gave no stamp."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _STAMP.size:
            sec, nsec = _STAMP.unpack_from(data)
            return min(now, now - (wall_now - (sec + nsec * 1e-9)))
    return now


@dataclass
class Head:
    status: int
    headers: dict[str, str]  # names lowercased; a repeated header keeps its last value

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


def parse_head(raw: bytes) -> Head:
    """A response's status line and headers (without the blank line that ends them)."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if parts[0] == "HTTP/1.0":
        headers.setdefault("connection", "close")
    return Head(int(parts[1]), headers)


@dataclass
class Reader:
    """One response's bytes in, its head and its body's pieces out: a body framed by
    Content-Length, by chunked transfer coding, or by the connection's end."""

    head: Head | None = None
    done: bool = False
    _buf: bytes = b""
    _left: int = -1  # body bytes still due (length framing) / of the current chunk (chunked)
    _chunked: bool = False
    _in_chunk: bool = False
    _trailer: bool = False
    closed: bool = False  # the server ended the connection

    def feed(self, data: bytes) -> list[bytes]:
        """The body bytes `data` completes (in order); `head` and `done` are set as reached."""
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        if self.head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return out
            self.head = parse_head(buf[:end])
            buf = buf[end + 4:]
            te = self.head.headers.get("transfer-encoding", "").lower()
            self._chunked = "chunked" in te
            if not self._chunked:
                length = self.head.headers.get("content-length")
                self._left = int(length) if length is not None else -1
                if self._left == 0 or self.head.status in (204, 304):
                    self.done = True
        if not self._chunked:
            if self._left >= 0:
                buf = buf[:self._left]
                self._left -= len(buf)
                self.done = self._left == 0
            if buf:
                out.append(buf)
            self._buf = b""
            return out
        while buf and not self.done:
            if self._trailer:  # after the last chunk: trailer lines, then a blank line
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                self.done = end == 0
                buf = buf[end + 2:]
            elif self._in_chunk:
                take = buf[:self._left]
                out.append(take)
                self._left -= len(take)
                buf = buf[len(take):]
                if self._left == 0:
                    self._in_chunk = False
                    self._left = -2  # the chunk's CRLF is due
            elif self._left == -2:
                if len(buf) < 2:
                    break
                buf = buf[2:]
                self._left = -1
            else:
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end].split(b";", 1)[0], 16)
                buf = buf[end + 2:]
                if size == 0:
                    self._trailer = True
                else:
                    self._left, self._in_chunk = size, True
        self._buf = buf
        return [p for p in out if p]

    def eof(self) -> None:
        """The connection ended: a body framed by the connection's end is complete; any other
        unfinished response is cut."""
        self.closed = True
        if self.head is not None and not self._chunked and self._left < 0:
            self.done = True
        if not self.done:
            raise ConnectionResetError("the server closed the connection mid-response")


class Wire:
    """A pool of keep-alive HTTP/1.1 connections to one server, at most `limit` in use at once."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port = host, port
        self._idle: list[socket.socket] = []
        self._slots = asyncio.Semaphore(limit)
        self.stamped = 0  # reads that carried the kernel's receive time
        self.reads = 0

    async def post(self, path: str, payload: bytes, on_head: OnHead, on_body: OnBody,
                   content_type: str = "application/json") -> Head:
        """Send one POST and read its answer, handing its head to `on_head` and each body piece
        to `on_body` as they are read; returns the head once the body has ended. A request on an
        idle connection that turns out closed before any answer is sent again once, on a fresh
        connection (as a browser or aiohttp does: the server may close an idle keep-alive)."""
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
        async with self._slots:
            for attempt in range(2):
                reused = attempt == 0 and bool(self._idle)
                sock = self._idle.pop() if reused else await self._connect()
                reader = Reader()
                try:
                    await asyncio.get_running_loop().sock_sendall(sock, request)
                    await self._read(sock, reader, on_head, on_body)
                except (ConnectionError, OSError) as exc:
                    sock.close()
                    if reused and reader.head is None and not isinstance(exc, TimeoutError):
                        continue  # the server had closed the idle connection
                    raise
                except BaseException:
                    sock.close()  # cancelled mid-answer: the connection's state is unknown
                    raise
                assert reader.head is not None
                if reader.head.keep_alive and not reader.closed:
                    self._idle.append(sock)
                else:
                    sock.close()
                return reader.head
        raise AssertionError("unreachable: the second attempt is on a fresh connection")

    async def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        except OSError:
            pass  # no kernel stamps here: reads are stamped with the loop's time only
        try:
            await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def _read(self, sock: socket.socket, reader: Reader, on_head: OnHead, on_body: OnBody) -> None:
        """Until the response ends, read whatever the socket holds each time it turns readable."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            while not finished.done():
                try:
                    data, anc, _, _ = sock.recvmsg(READ_SIZE, _ANC_SIZE)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    finished.set_exception(exc)
                    return
                now = time.perf_counter()
                try:
                    if not data:
                        reader.eof()
                    else:
                        self.reads += 1
                        at = now
                        if anc:
                            self.stamped += 1
                            at = arrival(anc, now, time.time())
                        had_head = reader.head is not None
                        pieces = reader.feed(data)
                        if not had_head and reader.head is not None:
                            on_head(reader.head, now, at)
                        for piece in pieces:
                            on_body(piece, now, at)
                except Exception as exc:  # noqa: BLE001 - a malformed answer ends this exchange
                    finished.set_exception(exc)
                    return
                if reader.done:
                    finished.set_result(None)

        fd = sock.fileno()
        loop.add_reader(fd, readable)
        try:
            await finished
        finally:
            loop.remove_reader(fd)

    @classmethod
    def to(cls, url: str, limit: int) -> Wire:
        """A pool for the server at `url` (http://host:port)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the load generator speaks plain http: {url!r}")
        return cls(parts.hostname, parts.port or 80, limit)

    async def __aenter__(self) -> Wire:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for sock in self._idle:
            sock.close()
        self._idle.clear()
