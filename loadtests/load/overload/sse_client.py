"""The load generator: open-loop sends over the stamped wire (`wire.py`), SSE streams read and
timed as read and on arrival, the door probe (a second client in its own process) and the
generator's own priority."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from tqdm import tqdm

from loadtests.load.overload.records import Rec, ReqSpec, is_openai_error, refuser
from loadtests.load.overload.summary import counts
from loadtests.load.overload.wire import Head, Wire


def sse_kind(event: bytes) -> str:
    """"content" | "done" | "error" | "other" for one SSE event (bytes between blank lines).

    Cheap byte checks, no JSON: a completion chunk with non-empty `text`, or a chat chunk with
    non-empty `content`, is content; the chat role chunk and the finishing chunks are "other".
    """
    event = event.strip()
    if not event.startswith(b"data:"):
        return "other"
    data = event[5:].lstrip()
    if data.startswith(b"[DONE]"):
        return "done"
    if data.startswith(b'{"error"'):
        return "error"
    if b'"text":"' in data and b'"text":""' not in data:
        return "content"
    if b'"content":"' in data and b'"content":""' not in data:
        return "content"
    return "other"


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events in `buf` and the unfinished rest."""
    if b"\r" in buf:
        buf = buf.replace(b"\r\n", b"\n")
    *events, rest = buf.split(b"\n\n")
    return [e for e in events if e.strip()], rest


STALL_S = 0.1  # the load generator's loop woke this late: its gaps then include it (kept with times)

HEADERS = {"Content-Type": "application/json"}


class Answer:
    """Fills `rec` from one answer as the wire reads it: the head, then for a streamed 200 every
    content event's time both as read and on arrival (TTFT, the gaps, [DONE], error events), for
    anything else the whole body, judged at its end."""

    def __init__(self, spec: ReqSpec, rec: Rec, t_sched: float) -> None:
        self.spec, self.rec, self.t_sched = spec, rec, t_sched
        self.buf = b""
        self.last: float | None = None
        self.last_at = 0.0
        self.worst = -1.0

    def head(self, head: Head, now: float, at: float) -> None:
        rec = self.rec
        rec.status, rec.headers_s, rec.headers_arrival_s = head.status, now - self.t_sched, at - self.t_sched

    def body(self, piece: bytes, now: float, at: float) -> None:
        rec = self.rec
        if rec.status != 200 or not self.spec.stream:
            self.buf += piece
            return
        events, self.buf = split_events(self.buf + piece)
        for event in events:
            kind = sse_kind(event)
            if kind == "content":
                if self.last is None:
                    rec.ttft_s = now - self.t_sched
                else:
                    if now - self.last > self.worst:
                        self.worst, rec.worst_gap_at_s = now - self.last, rec.sched_s + now - self.t_sched
                    rec.gaps.append(now - self.last)
                    rec.arrival_gaps.append(max(0.0, at - self.last_at))
                self.last, self.last_at = now, at
                rec.chunks += 1
            elif kind == "done":
                rec.done = True
            elif kind == "error":
                rec.error_event = True

    def end(self, head: Head) -> None:
        rec = self.rec
        if rec.status == 200 and self.spec.stream:
            return
        if rec.status == 200:
            rec.ttft_s = time.perf_counter() - self.t_sched
        try:
            data = json.loads(self.buf)
        except ValueError:
            data = None
        if rec.status == 200:
            rec.error_event = isinstance(data, dict) and "error" in data
            rec.done = isinstance(data, dict) and bool(data.get("choices"))
            return
        rec.retry_after = "retry-after" in head.headers
        rec.json_body = data is not None
        rec.openai_body = is_openai_error(data)
        if rec.status == 429 and rec.openai_body:
            rec.refused_by = refuser(str(data["error"].get("message", "")))


async def _exchange(wire: Wire, spec: ReqSpec, rec: Rec, t_sched: float) -> None:
    answer = Answer(spec, rec, t_sched)
    answer.end(await wire.post(spec.path, spec.payload, answer.head, answer.body))


async def send(wire: Wire, spec: ReqSpec, rec: Rec, t_sched: float, timeout_s: float) -> Rec:
    """One request, filled into `rec`; the whole exchange is bounded by `timeout_s`."""
    try:
        await asyncio.wait_for(_exchange(wire, spec, rec, t_sched), timeout_s)
    except asyncio.TimeoutError:
        rec.timed_out = True
    except Exception as exc:  # noqa: BLE001 - any transport failure is a result, not a crash
        rec.exc = type(exc).__name__
    finally:
        rec.end_s = time.perf_counter() - t_sched
    return rec


@dataclass
class Launched:
    """The tasks an open-loop run started, and its records (filled in as they finish)."""

    t0: float
    t_end: float
    recs: list[Rec]
    tasks: list[asyncio.Task[Rec]]
    max_lag_s: float = 0.0  # how far behind its schedule the generator fell at worst


async def open_loop(wire: Wire, specs: Sequence[ReqSpec], offsets: Sequence[float],
                    timeout_s: float, bar: tqdm) -> Launched:
    """Start every request at its offset without waiting for any answer (open loop).

    Returns when the last one is sent; latencies count from the scheduled time, so a client
    that falls behind still measures the wait it caused."""
    t0 = time.perf_counter()
    recs: list[Rec] = []
    tasks: list[asyncio.Task[Rec]] = []
    last_post, max_lag = t0, 0.0
    for spec, off in zip(specs, offsets):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = time.perf_counter() - t0 - off
        max_lag = max(max_lag, lag)
        rec = Rec(spec.kind, off, send_lag_s=lag)
        recs.append(rec)
        tasks.append(asyncio.create_task(send(wire, spec, rec, t0 + off, timeout_s)))
        bar.update(1)
        if time.perf_counter() - last_post > 1.0:
            last_post = time.perf_counter()
            bar.set_postfix_str(_live(recs, tasks))
    return Launched(t0, time.perf_counter(), recs, tasks, max_lag)


def _live(recs: Sequence[Rec], tasks: Sequence[asyncio.Task[Rec]]) -> str:
    done = [r for r, t in zip(recs, tasks) if t.done()]
    c = counts(done)
    return f"open {len(tasks) - len(done)} ok {c['ok']} 429 {c['429']} other {len(done) - c['ok'] - c['429']}"


def raise_priority(nice: int) -> int | None:
    """Give every thread of this process CPU niceness `nice` (negative: ahead of the server's
    processes); the niceness it has then, or None when the OS refused (not privileged).

    The load generator stands in for clients on other machines: on a machine it shares with
    the server, it would otherwise wait for the CPU behind the server it overloads, and its own
    delay in reading an answer would count as the server's latency. Called after the server is
    started, so the server's processes keep their own niceness."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except (OSError, ValueError):
        return None
    return os.getpriority(os.PRIO_PROCESS, 0)


def door_probe(url: str, body: bytes, start_wall: float, duration_s: float, interval_s: float,
               timeout_s: float) -> list[tuple[float, int | None, float]]:
    """A second, light client, run in its own process: one small non-streaming request every
    `interval_s` from `start_wall` (time.time()) for `duration_s`, each on a new connection,
    sequentially; per request (scheduled offset, status or None, seconds from send to the whole
    answer). What the door's answers cost a client that is not itself loaded by thousands of
    streams."""
    parts = urlsplit(url)
    out: list[tuple[float, int | None, float]] = []
    k = 0
    while k * interval_s <= duration_s:
        delay = start_wall + k * interval_s - time.time()
        if delay > 0:
            time.sleep(delay)
        t = time.perf_counter()
        status = None
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
            try:
                conn.request("POST", "/v1/completions", body, HEADERS)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):  # refused, reset, a malformed answer
            pass
        out.append((round(k * interval_s, 3), status, time.perf_counter() - t))
        k += 1
    return out


async def drain(run: Launched, timeout_s: float | None) -> None:
    """Wait for the run's requests; after `timeout_s` cancel the rest (marked abandoned)."""
    if not run.tasks:
        return
    _, pending = await asyncio.wait(run.tasks, timeout=timeout_s)
    for rec, task in zip(run.recs, run.tasks):
        if task in pending:
            rec.abandoned = True
            task.cancel()
    if pending:
        await asyncio.wait(pending)


async def sequential(wire: Wire, specs: Sequence[ReqSpec], timeout_s: float) -> list[Rec]:
    """Requests one after another (unloaded latencies)."""
    out: list[Rec] = []
    for spec in specs:
        t = time.perf_counter()
        out.append(await send(wire, spec, Rec(spec.kind, 0.0), t, timeout_s))
    return out
