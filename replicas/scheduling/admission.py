"""Token admission: how many waiting prompt tokens a replica takes, and when to come back.

Pure functions, shared by the replica's own intake (`replicas.serving.deployment`) and the cluster's
door (`app.admission`, which sums them over the replicas' load reports), so both refuse by
the same rule and a 429's Retry-After means the same thing wherever it is computed.

The bound a replica's waiting queue may hold is derived from its own budgets:

    bound = min(drain_tps * queue_timeout_s * QUEUE_FILL, max_queued_tokens)

where `drain_tps` is the rate at which its waiting prompt tokens are actually being prefilled
(measured; see `drain_rate`). A prompt admitted past that bound would wait longer than the queue
deadline for its first pass, and be refused then (`Scheduler.expire` refuses it as soon as its
predicted start passes the deadline), after occupying the queue: refusing it at once is cheaper
for everyone. The queue is filled to a fraction of the deadline because the drain slows as the
requests admitted start decoding (under a TBT SLO their decodes shrink each pass's prompt
budget): a request must not be admitted on a rate that will not hold until its start. Without
a deadline the bound is `max_queued_tokens`. An empty queue always admits (so one prompt longer
than the bound is still served, and a stalled queue, bound 0, keeps one request at its head).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_RETRY_AFTER_S = 60
DRAIN_WINDOW_S = 2.0  # passes this recent measure the drain rate
MIN_BACKLOG_S = 0.5  # a backlog younger than this is judged by capacity, not by what it achieved
QUEUE_FILL = 0.25  # admit a quarter of what drains within the deadline (see above)


class PassRecord(Protocol):
    """What `drain_rate` reads of an `IterationStats`."""

    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill_budget: int | None  # the SLO budget's prompt tokens for the pass (None: the fixed budget)
    queue_held: bool  # SLO admission held the waiting head back: nothing starts until a stream ends


def drain_rate(passes: Sequence[PassRecord], budget_tokens: int, backlog_since: float | None,
               now: float, window_s: float = DRAIN_WINDOW_S,
               min_backlog_s: float = MIN_BACKLOG_S, running_since: float | None = None) -> float | None:
    """Prompt tokens per second this replica prefills; None when there is nothing to go by.

    `backlog_since`: when the waiting queue last became non-empty (None: it is empty). A
    backlog older than `min_backlog_s` is measured by what it achieved: the prompt tokens
    prefilled since it formed (at most `window_s` back), per second of wall time (passes the
    queue spent blocked on KV or sequence slots count; 0.0 when nothing was prefilled or nothing
    ran: a stalled queue). Idle time before the backlog does not count against it: a burst
    arriving at an idle replica is not judged by the quiet second before it. Without a backlog,
    or with a younger one, the achieved rate only shows the arrivals, so the capacity of the
    recent passes counts too: per pass, the token budget left after its decodes; with no recent
    pass, None (unmeasured). When the newest pass's SLO admission held the waiting head back,
    nothing starts until a stream ends: 0.0 (stalled), whatever the passes show; when one of the
    recent passes did, the streams are full and a new prompt starts only as one ends, so the
    rate is what was achieved, not the capacity (an empty queue then would otherwise admit a
    burst on the capacity, refused as soon as it waits behind the held head).

    `running_since`: when the pass in progress began (None: none is). The backlog is judged up to
    then: a pass still running has prefilled nothing yet that the record shows, and one long
    pass (a whole 2k-token prompt under the dynamic policy takes seconds on a CPU) is not a
    stalled queue; counted as one, it had refused prompts an idle second later would take.
    """
    seen = now if running_since is None else min(now, running_since)  # what completed passes show
    if passes and backlog_since is not None and passes[-1].queue_held:
        return 0.0
    if backlog_since is not None and seen - backlog_since >= min_backlog_s:
        start = max(seen - window_s, backlog_since)
        achieved = 0
        for p in reversed(passes):  # newest last: stop at the first that ended before `start`
            if p.start + p.duration <= start:
                break
            achieved += p.num_prefill_tokens
        return achieved / max(seen - start, 1e-6)
    start = seen - window_s
    recent = []
    for p in reversed(passes):  # newest last; stop at the window's edge
        if p.start < start:
            break
        recent.append(p)
    if not recent:
        return None
    span = max(seen - recent[-1].start, sum(p.duration for p in recent), 1e-6)
    achieved = sum(p.num_prefill_tokens for p in recent) / span
    if any(p.queue_held for p in recent):
        return achieved
    return max(achieved, _capacity(recent, budget_tokens))


def _capacity(recent: Sequence[PassRecord], budget_tokens: int) -> float:
    """Prompt tokens per second the passes could prefill with the budget left after the newest
    pass's decodes (under a TBT SLO, at most the prompt budget the SLO gave that pass: with many
    streams decoding it is a small part of the fixed one). A pass's time grows with the tokens it
    carries, so a full pass (those decodes and that budget) costs the per-token time of the recent
    passes that prefilled: quick decode-only passes must not promise a quick prefill (a burst
    admitted on that promise waits past its deadline). With no pass that prefilled, the
    decode-only passes' time is all there is."""
    newest = recent[0]
    left = max(0, budget_tokens - newest.num_decode_tokens)
    if newest.prefill_budget is not None:
        left = min(left, newest.prefill_budget)
    prefilled = [p for p in recent if p.num_prefill_tokens]
    if prefilled:
        tokens = sum(p.num_prefill_tokens + p.num_decode_tokens for p in prefilled)
        full = newest.num_decode_tokens + left
        return left / max(full * sum(p.duration for p in prefilled) / tokens, 1e-6)
    busy = sum(p.duration for p in recent)
    return sum(max(0, budget_tokens - p.num_decode_tokens) for p in recent) / max(busy, 1e-6)


def queue_bound(max_queued_tokens: int, drain_tps: float | None, queue_timeout_s: float | None) -> int:
    """Waiting prompt tokens a replica admits (see the module docstring).

    Unmeasured (None) or no deadline: `max_queued_tokens`. A stalled queue (0.0): 0, so only an
    empty one admits (whoever waited behind its head would be refused at once, `Scheduler.expire`).
    """
    if queue_timeout_s is None or drain_tps is None:
        return max_queued_tokens
    return min(max_queued_tokens, int(drain_tps * queue_timeout_s * QUEUE_FILL))


def admits(queued_tokens: int, prompt_tokens: int, bound: int) -> bool:
    """The admission rule: an empty queue takes anything; otherwise stay within the bound."""
    return queued_tokens <= 0 or queued_tokens + prompt_tokens <= bound


STALLED_RETRY_AFTER_S = 5  # nothing drains now: come back in a while, not at once


def retry_after_s(excess_tokens: int, drain_tps: float | None,
                  fallback_s: int = STALLED_RETRY_AFTER_S) -> int:
    """Whole seconds until `excess_tokens` of the queue have drained at `drain_tps` (1..60)."""
    if drain_tps is None or drain_tps <= 0:
        return max(1, min(MAX_RETRY_AFTER_S, fallback_s))
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(excess_tokens / drain_tps)))


@dataclass(frozen=True)
class QueueView:
    """One replica's queue as its load report shows it."""

    waiting_tokens: int
    bound_tokens: int
    drain_tps: float  # 0.0 when stalled or unmeasured


@dataclass(frozen=True)
class Decision:
    """The door's answer for one request."""

    admitted: bool
    queued_tokens: int
    bound_tokens: int
    retry_after_s: int | None = None


def door_decision(prompt_tokens: int, queues: Iterable[QueueView], unreflected_tokens: int = 0) -> Decision:
    """Admit at the cluster's door when the replicas' queues, together, have room.

    `unreflected_tokens` corrects the reports by what this door knows better: prompts it
    admitted that no report shows yet, less those that left the queue since. With no
    report at all there is no view to refuse on: admit, and let the replicas' own bounds decide.
    """
    views = list(queues)
    if not views:
        return Decision(True, unreflected_tokens, 0)
    queued = max(0, sum(v.waiting_tokens for v in views) + unreflected_tokens)
    bound = sum(v.bound_tokens for v in views)
    if admits(queued, prompt_tokens, bound):
        return Decision(True, queued, bound)
    drain = sum(max(0.0, v.drain_tps) for v in views)
    return Decision(False, queued, bound, retry_after_s(queued + prompt_tokens - bound, drain))
