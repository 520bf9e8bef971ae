"""Garbage collection that does not stall a serving process: start-up's objects frozen, and
young collections seldom.

CPython's cycle collector stops the process (it holds the GIL) while it walks a generation. A
replica under load showed both ways this hurts, every stream of the replica stalling at once
(10x overload on embedded:tiny, docs/results/http_path.md, "Garbage collection"):

- A full collection walks every tracked object, and start-up alone leaves ~450,000 in a replica
  (Ray, torch, transformers, FastAPI, the model's modules) that live as long as the process. One
  ran every ~2 s and held the GIL 100-150 ms.
- With those frozen, full collections still came every ~3 s and took as long: at CPython's
  default of a young collection every 700 net allocations (47 a second here), a request's
  objects (it lives 1-3 s) were promoted to the oldest generation before they died, and that
  held ~120,000 of them.

So once a process has started, it collects once, moves everything left into the permanent
generation (`gc.freeze`, as vLLM and SGLang do after start-up), and raises the young generation's
threshold (as Ray Serve does in its proxy, and SGLang's `--gc-threshold`): most of a request's
objects are then freed by reference count before any collection sees them, and full collections
stop (none in a 30 s overload, against 11).

Only in a process of its own (a Ray worker, the engine process): in a test's process, freezing
would keep every cycle of everything built before it for the rest of the run.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

# Net allocations of tracked objects between young collections (CPython's default: 700). What a
# young collection walks is the live objects made since the last one, which a busy replica's
# streams bound (~390 objects, ~1,900 references a stream), not this threshold; the threshold
# sets how often. In a 10x overload on embedded:tiny (docs/results/http_path.md, "Garbage
# collection"), 10,000 ran 28 young and 2 middle collections (TBT p99 117 ms); 50,000 ran 4 young
# ones of 20-120 ms in the overload's first seconds (TBT p99 77-98 ms); 200,000 runs one
# (110-140 ms; TBT p99 76 ms twice), with the same peak memory: a request leaves almost no cyclic
# garbage (0-128 objects found per collection). Idle replicas collect everything anyway
# (`app.memory.trim_when_idle`).
GEN0_THRESHOLD = 200_000


def in_worker_process() -> bool:
    """True in a Ray worker (a Serve replica, its proxy): a process that serves and nothing else."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - no Ray here
        return False


def freeze_startup_objects(log: logging.Logger, what: str, own_process: bool | None = None) -> int:
    """Collect once, freeze every object tracked so far and raise the young generation's
    threshold to GEN0_THRESHOLD; returns how many objects are frozen (0: not in a process of its
    own, nothing done). `own_process`: None asks `in_worker_process()`. Called again (a second
    part of the same process started), it freezes what came since."""
    if not (in_worker_process() if own_process is None else own_process):
        return 0
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects from start-up frozen out of garbage collection, young collections every %d "
             "allocations (%.0f ms)", what, frozen, GEN0_THRESHOLD, 1000 * (time.perf_counter() - start))
    return frozen


def gc_state() -> dict[str, Any]:
    """What /health says of this process's collector: objects frozen, thresholds, and the
    collections run so far by generation."""
    return {"frozen": gc.get_freeze_count(), "threshold": list(gc.get_threshold()),
            "collections": [s["collections"] for s in gc.get_stats()]}
