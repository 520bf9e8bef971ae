"""What keeps a device run's figures when the run is cut short: a JSON file rewritten whole (and
atomically) after every stage, a stage's error caught and recorded, and a time limit that cuts a
stage in the middle instead of waiting for it to end.

A lent device gives one short call; a `run` that overruns its limit is killed, and only what is
already on disk comes back. So every stage ends by saving, a stage that raises is recorded and the
next one runs, and a stage's budget is enforced inside it (`time_limit`: SIGALRM raises `Cut` in
the main thread at the next Python bytecode, in the middle of a compile or a decode loop).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


class Cut(BaseException):
    """A stage's time ran out. A BaseException, so no `except Exception` in the code under test
    (the runner's fallback, torch's own handlers) swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `Cut` in this (main) thread once `seconds` have passed; at once if none are left."""
    if seconds <= 0:
        raise Cut(f"no time left ({seconds:.1f} s)")

    def on_alarm(signum: int, frame: Any) -> None:
        raise Cut(f"cut after {seconds:.1f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def save_json(path: str | Path | None, data: Any) -> None:
    """`data` to `path` whole: written beside it, then renamed over it (a kill mid-write leaves the
    previous version, never half a file)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float) + "\n")
    os.replace(tmp, path)


def release(device: torch.device) -> None:
    """What a finished stage held, back to the device (its engines are garbage by now)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_limited(fn: Callable[[dict[str, Any]], Any], record: dict[str, Any], seconds: float) -> str:
    """Run `fn(record)` (it fills `record` as it goes, so a cut keeps what it had) within
    `seconds`; the record gets its status ("complete", "cut", "error"), seconds and any error.
    Returns the status."""
    start = time.perf_counter()
    try:
        with time_limit(seconds):
            fn(record)
        status = "complete"
    except Cut as cut:
        status, record["cut"] = "cut", str(cut)
    except Exception:  # recorded, and the run goes on: one failure must not cost the rest
        status, record["error"] = "error", traceback.format_exc(limit=-8)
    record["status"] = status
    record["seconds"] = round(time.perf_counter() - start, 2)
    return status
