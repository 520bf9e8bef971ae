"""loadtests/load/overload/wire.py: the load generator's client frames every answer the server
may send (length, chunked, to the connection's end), reuses its connections, and stamps each
read with a kernel receive time that is never later than the read itself."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from loadtests.load.overload import wire

pytestmark = pytest.mark.unit


def feed_all(reader: wire.Reader, pieces: list[bytes]) -> bytes:
    return b"".join(b for piece in pieces for b in reader.feed(piece))


def test_a_chunked_body_comes_out_whole_however_the_reads_cut_it() -> None:
    """Chunk sizes, extensions, the chunks' CRLFs and the trailer split at every byte."""
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
           b"5\r\nhello\r\n1a;ext=1\r\ndata: abcdefghijklmnopqr\n\n\r\n0\r\nX-Trailer: 1\r\n\r\n")
    for cut in range(1, 12):
        reader = wire.Reader()
        body = feed_all(reader, [raw[i:i + cut] for i in range(0, len(raw), cut)])
        assert body == b"hellodata: abcdefghijklmnopqr\n\n", cut
        assert reader.done and reader.head is not None and reader.head.status == 200
        assert reader.head.headers["content-type"] == "text/event-stream" and reader.head.keep_alive


def test_a_length_framed_body_stops_at_its_length_and_an_empty_one_is_done_at_once() -> None:
    reader = wire.Reader()
    assert feed_all(reader, [b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 7\r\nRetry-After: 1\r\n",
                             b"\r\n{\"a\":", b"1}"]) == b'{"a":1}'
    assert reader.done and reader.head is not None and reader.head.headers["retry-after"] == "1"
    empty = wire.Reader()
    assert empty.feed(b"HTTP/1.1 204 No Content\r\n\r\n") == [] and empty.done


def test_a_body_to_the_connections_end_is_done_at_eof_and_a_cut_one_raises() -> None:
    reader = wire.Reader()
    assert feed_all(reader, [b"HTTP/1.0 200 OK\r\n\r\nabc", b"def"]) == b"abcdef" and not reader.done
    reader.eof()
    assert reader.done and reader.closed and reader.head is not None and not reader.head.keep_alive
    cut = wire.Reader()
    cut.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ConnectionResetError):
        cut.eof()
    with pytest.raises(ValueError, match="status line"):
        wire.Reader().feed(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_the_kernel_stamp_maps_onto_the_readers_clock_and_never_after_the_read() -> None:
    stamp = struct.pack("qq", 1000, 250_000_000)  # wall 1000.25
    anc = [(socket.SOL_SOCKET, wire.SO_TIMESTAMPNS, stamp)]
    assert wire.arrival(anc, now=50.0, wall_now=1000.30) == pytest.approx(49.95)
    assert wire.arrival(anc, now=50.0, wall_now=1000.20) == 50.0  # clocks disagree: never later
    assert wire.arrival([], now=50.0, wall_now=1000.3) == 50.0


async def _serve(answers: list[bytes], close_after: set[int]) -> tuple[asyncio.AbstractServer, list[int], int]:
    """A server answering its k-th request with answers[k] (each written in 2 writes, 20 ms
    apart), closing the connection after the requests in `close_after`; the connections it
    accepted are counted."""
    seen = [0]
    conns: list[int] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            await answer_each(r, w)
        except (asyncio.IncompleteReadError, asyncio.CancelledError, ConnectionError):
            pass  # the client closed its connection, or the test ended
        w.close()

    async def answer_each(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await r.readexactly(length)
            k = seen[0]
            seen[0] += 1
            answer = answers[k]
            w.write(answer[:len(answer) // 2])
            await w.drain()
            await asyncio.sleep(0.02)
            w.write(answer[len(answer) // 2:])
            await w.drain()
            if k in close_after:
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, conns, server.sockets[0].getsockname()[1]


def test_the_pool_reuses_a_connection_and_retries_one_the_server_closed() -> None:
    """Three posts in turn: the first two share a connection; the server closes it after the
    second (Connection: close is not sent), so the third finds it dead, reconnects, and gets its
    answer. Each read is stamped no later than it was read."""
    sse = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"x\":1}\n\n\r\n0\r\n\r\n")
    plain = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}"

    async def main() -> tuple[list[int], list[tuple[bytes, float, float]], list[int], int, int]:
        server, conns, port = await _serve([sse, plain, sse], close_after={1})
        pieces: list[tuple[bytes, float, float]] = []
        statuses: list[int] = []
        async with server, wire.Wire("127.0.0.1", port, limit=4) as pool:
            for _ in range(3):
                heads: list[int] = []
                head = await pool.post("/v1/completions", b"{}", lambda h, now, at: heads.append(h.status),
                                       lambda p, now, at: pieces.append((p, now, at)))
                assert heads == [head.status]
                statuses.append(head.status)
                await asyncio.sleep(0.05)  # the server's close lands before the next post
            return statuses, pieces, conns, pool.reads, pool.stamped

    statuses, pieces, conns, reads, stamped = asyncio.run(main())
    assert statuses == [200, 429, 200] and len(conns) == 2
    body = b"".join(p for p, _, _ in pieces)
    assert body == b'data: {"x":1}\n\n{}data: {"x":1}\n\n'
    assert all(at <= now for _, now, at in pieces)
    # Linux stamps the reads of a socket that asked, once its receive-time stamping is switched
    # on (deferred: the very first packets after the first request may come unstamped).
    assert reads >= 6 and 0 < stamped <= reads


def test_a_request_on_a_dead_idle_connection_is_sent_again_once_on_a_fresh_one() -> None:
    """Two connections left idle, both closed by the server: the next post finds the first dead
    and goes out on a new connection, not on the second dead one."""
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

    async def main() -> tuple[list[int], int]:
        server, conns, port = await _serve([plain] * 3, close_after={0, 1})
        async with server, wire.Wire("127.0.0.1", port, limit=4) as pool:
            post = lambda: pool.post("/", b"", lambda h, n, a: None, lambda p, n, a: None)  # noqa: E731
            heads = await asyncio.gather(post(), post())  # two connections at once
            await asyncio.sleep(0.05)  # the server has closed both
            heads.append(await post())
            return [h.status for h in heads], len(conns)

    statuses, connections = asyncio.run(main())
    assert statuses == [200, 200, 200] and connections == 3


def test_a_cancelled_exchange_closes_its_connection() -> None:
    """A post cancelled mid-answer (the run's timeout) leaves no connection in the pool."""
    slow = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd"

    async def main() -> int:
        server, _, port = await _serve([slow], close_after=set())
        async with server, wire.Wire("127.0.0.1", port, limit=1) as pool:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.post("/", b"", lambda h, n, a: None, lambda p, n, a: None), 0.005)
            return len(pool._idle)

    assert asyncio.run(main()) == 0


def test_only_plain_http_urls() -> None:
    assert (wire.Wire.to("http://127.0.0.1:8000", 3).port, wire.Wire.to("http://h", 3).port) == (8000, 80)
    with pytest.raises(ValueError, match="plain http"):
        wire.Wire.to("https://h:1", 3)
