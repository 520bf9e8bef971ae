"""The machine's processes as /proc shows them: which a server started, and ending them.

A server's processes are not one process group: Ray's raylet starts each worker (every replica,
the HTTP proxy) in a session of its own. What a load test started is found instead by its roots
(the commands it ran) and by a mark in their command lines (the private Ray temp dir that every
Ray process of that instance is given), with every descendant of either, and the HAProxy of
Ray's HAProxy mode, which runs under a path named by the instance's node id, not by the mark,
and outlives its manager when that is killed (it is no one's descendant then).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

Proc = tuple[int, str, int, int]  # (parent pid, command line, RSS bytes, start time in clock ticks)
NODE_ID = re.compile(r"--node[-_]id=([0-9a-f]{16,})")  # in the raylet's and the GCS's command lines
HAPROXY_DIR = "/haproxy-serve/{}/"  # Ray's HAProxy config and socket dir: /tmp/haproxy-serve/<node id>/


def table() -> dict[int, Proc]:
    """Every process now: pid -> (parent pid, command line, RSS bytes, start time)."""
    page = os.sysconf("SC_PAGE_SIZE")
    out: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
            out[int(entry)] = (int(fields[1]), cmd.strip(), int(fields[21]) * page, int(fields[19]))
        except (OSError, ValueError, IndexError):  # it ended while we read it
            continue
    return out


def tree(procs: dict[int, Proc], roots: Iterable[int], mark: str | None = None) -> set[int]:
    """The live `roots`, the processes whose command line holds `mark`, and all their descendants."""
    keep = {pid for pid in roots if pid in procs}
    if mark:
        keep |= {pid for pid, (_, cmd, _, _) in procs.items() if mark in cmd}
    dirs = {HAPROXY_DIR.format(node) for pid in keep for node in NODE_ID.findall(procs[pid][1])}
    keep |= {pid for pid, (_, cmd, _, _) in procs.items()
             if cmd.split(" ", 1)[0].endswith("haproxy") and any(d in cmd for d in dirs)}
    frontier = set(keep)
    while frontier:
        frontier = {pid for pid, (ppid, _, _, _) in procs.items() if ppid in frontier} - keep
        keep |= frontier
    return keep


def started(roots: Iterable[int], mark: str | None = None) -> dict[int, int]:
    """`tree` of the processes now, each with its start time (what `terminate` takes)."""
    procs = table()
    return {pid: procs[pid][3] for pid in tree(procs, roots, mark)}


def terminate(started: dict[int, int], grace_s: float = 10.0) -> None:
    """SIGTERM each process of `started` (pid -> start time); SIGKILL the ones still there after
    `grace_s`, and wait (up to `grace_s` again) until they are gone. A pid whose start time differs is another process that took a freed number: left alone."""
    pending = set(started)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        now = table()
        pending = {pid for pid in pending if pid in now and now[pid][3] == started[pid]
                   and not ended(pid)}
        for pid in pending:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        # SIGTERM gets the grace period; a SIGKILLed process is gone once the kernel has torn it
        # down, which on a busy machine is not at once: wait for that too.
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            time.sleep(0.2)
            pending = {pid for pid in pending if not ended(pid)}


def ended(pid: int) -> bool:
    """Ended (a zombie, not yet reaped by its parent, or gone)."""
    try:
        return Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Processes started in this block get SIGINT's default action even where this process
    ignores it (started in the background by a shell without job control, or by `nohup`):
    Python installs its KeyboardInterrupt handler only where SIGINT is not ignored at start, so
    a `serve run` started from such a process sat out the SIGINT that stops it, and its stopper
    waited out its whole grace (60 s a server in a test run started that way)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
