"""Where a pass's device work runs: the device itself (`Immediate`), or a stand-in for measuring
the overlapped loop without a GPU (`StandInDevice`).

On CUDA the model runner's kernels are queued and the host returns at once; on CPU torch computes
before it returns. The runner hands each pass's device part (forward, sampling, the copy back
started) to its queue as one call, so a stand-in can run it on a worker thread and hold it for a
set device time while the host goes on, as a GPU would.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class Job:
    """One pass's device work, submitted: its result once done, and when the device ran it
    (perf_counter; on CUDA the runner times the kernels with events instead)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.started = self.finished = 0.0
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self, hold_s: float = 0.0) -> None:
        self.started = time.perf_counter()
        try:
            self._result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            self._error = exc
        if hold_s > 0:  # the rest of the pass's device time: the GIL is free meanwhile
            time.sleep(max(0.0, self.started + hold_s - time.perf_counter()))
        self.finished = time.perf_counter()
        self._done.set()

    def result(self) -> Any:
        """Wait for the work; its return value (or its exception, raised here)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Immediate:
    """The device runs the work as it is submitted (torch queues it on CUDA, runs it on CPU)."""

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        job.run()
        return job

    def close(self) -> None:
        pass


class StandInDevice:
    """A worker thread standing in for a GPU: each pass computes the real forward there, then
    holds until `device_s` after it started (sleeping, so the host thread runs meanwhile), one
    pass after the other in submission order. `idle` lists the device's wait before each pass
    after the first (perf_counter seconds)."""

    def __init__(self, device_s: float) -> None:
        self.device_s = device_s
        self.idle: list[float] = []
        self.jobs: list[Job] = []  # every pass run, in order (tests read their start times)
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="stand-in-device", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        self._queue.put(job)
        return job

    def _work(self) -> None:
        last_end: float | None = None
        while (job := self._queue.get()) is not None:
            wait_start = time.perf_counter()
            if last_end is not None:  # idle: from the previous pass's end to this one's start
                self.idle.append(max(0.0, wait_start - last_end))
            job.run(self.device_s)
            self.jobs.append(job)
            last_end = job.finished

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
