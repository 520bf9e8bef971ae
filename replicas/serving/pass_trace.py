"""A per-pass trace: one JSON line for every forward pass an engine runs (an engine observer).

What the metrics aggregate, kept pass by pass, for finding why a stream saw a long gap: the pass's
wall time beside its prediction, the target the SLO budget aimed at and the budget it chose, and
the CPU time the process got during it (a pass much longer than its CPU time with one torch
thread waited for a core). Enabled with the app's `pass_trace_dir`; each replica writes
`passes-<pid>.jsonl` there. A line:

    {"time": 1733241600.123, "duration_s": 0.412, "cpu_s": 0.405, "predicted_s": 0.398,
     "pass_target_s": 0.8, "prefill_budget": 640, "prefill_tokens": 640, "decode_tokens": 12,
     "sequences": 13, "context_tokens": 5120, "preempted": 0, "stalled": 0, "fallback": false}

`time` is the wall clock at the pass's start (comparable with a load generator's records).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

# Buffered lines go to the file at the first pass this long after the last write, and when the
# engine goes idle. About 250 bytes a pass: ~30 MB an hour at 30 passes a second.
FLUSH_EVERY_S = 1.0


class PassTrace:
    """Appends every pass's `IterationStats` to a JSONL file."""

    def __init__(self, directory: str | os.PathLike[str], clock: Any = time.time) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"passes-{os.getpid()}.jsonl"
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")
        self._clock = clock
        self._flushed_at = clock()
        # perf_counter -> wall clock, taken once: a pass's `start` is on the perf_counter clock.
        self._offset = clock() - time.perf_counter()

    def on_iteration(self, stats: Any, batch: Any, engine: Any) -> None:
        if self._file.closed:
            return
        line = {"time": round(stats.start + self._offset, 6), "duration_s": stats.duration,
                "cpu_s": stats.cpu_s, "predicted_s": stats.predicted_s,
                "pass_target_s": stats.pass_target_s, "prefill_budget": stats.prefill_budget,
                "prefill_tokens": stats.num_prefill_tokens, "decode_tokens": stats.num_decode_tokens,
                "sequences": stats.num_seqs, "context_tokens": stats.context_tokens,
                "preempted": stats.num_preempted, "stalled": stats.num_stalled,
                "fallback": stats.budget_fallback}
        try:
            self._file.write(json.dumps(line) + "\n")
            now = self._clock()
            if now - self._flushed_at >= FLUSH_EVERY_S:
                self._file.flush()
                self._flushed_at = now
        except OSError as exc:  # a full disk stops the trace, never the engine
            self._stop(exc)

    def on_abort(self, request: Any) -> None:
        pass

    def on_idle(self, engine: Any) -> None:
        """Idle: what is buffered goes out."""
        if self._file.closed:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self._stop(exc)
        self._flushed_at = self._clock()

    def _stop(self, exc: OSError) -> None:
        log.error("pass trace %s stopped: %s", self.path, exc)
        try:
            self._file.close()
        except OSError:
            pass

    def close(self) -> None:
        self._file.close()
