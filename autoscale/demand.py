"""Demand the fleet served and refused, as rates over a window (pure; the controller and the
simulator keep one each).

Admission keeps TBT and queues low by refusing work: the door, the ingress, a replica's queue
bound and SLO admission answer 429 instead of letting streams slow down. The scaling signals
that admission protects (TBT p99, queued tokens, token load) therefore stay low while demand goes
unserved, so the autoscaler needs the demand itself: tokens per second (prompt + max_tokens) of
requests served and of requests refused, wherever they were refused (`scaling.refusing`).

Every source keeps monotone counters (`DemandCounts`) and reports them now and then: the
ingress counts every request it answers (served once it has a first token; refused when it
answers 429, whoever refused: its own token door, Serve's queue, a replica's queue bound, the
queue deadline, SLO admission; or 503 before a first token: no replica could start it), the proxy door counts the requests it refuses before anyone reads
their bodies (unsized: they are counted at the mean size of the requests served in the window).
A client that retries a refused request asks for the same demand again. OpenAI's SDKs (and the
other Stainless-built ones) say so in `x-stainless-retry-count`; the ingress counts such a
request as retried too, and the log takes retried tokens off the refused ones, so a request
refused, retried and served counts once, as served, and one refused three times counts once,
as refused. The unsized refusals (the proxy door, the in-flight limits) leave marked retries out.
A retry from a client that does not say so still counts again, and so does a retry of a stream
that broke after its first token (served twice).
`DemandLog` turns successive counter values into timestamped increments and reads rates over any
part of its window. The first value a source reports is its baseline (what it counted before the
log knew it is history, not a burst).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace

__all__ = ["REPORT_EVERY_S", "Demand", "DemandCounter", "DemandCounts", "DemandLog"]

REPORT_EVERY_S = 1.0  # a source sends its counters at most this often, and only when they moved


@dataclass(frozen=True)
class DemandCounts:
    """A source's monotone counters (or, in the log, the increments of one report)."""

    served_tokens: int = 0  # prompt + max_tokens of requests that got a first token
    served_requests: int = 0
    refused_tokens: int = 0  # prompt + max_tokens of requests refused with their size known
    refused_unsized: int = 0  # requests refused before their size was read (the proxy door)
    retried_tokens: int = 0  # prompt + max_tokens of requests that are a client's retry (served or refused)

    def __sub__(self, other: DemandCounts) -> DemandCounts:
        return DemandCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def latest(self, other: DemandCounts) -> DemandCounts:
        """The later of two reports of one source's counters, whichever came first: they only
        grow, so field by field the larger (a report by actor call overtaken by a datagram)."""
        return DemandCounts(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))


# A source's counters as they travel with its replica's load report, through the node relays
# (`LoadReporter.demand`): (the deployment's key, the source, its counters).
Demand = tuple[str, str, DemandCounts]


class DemandCounter:
    """A source's counters as it counts them (the ingress, the proxy door), and when to send."""

    def __init__(self) -> None:
        self._counts = DemandCounts()
        self._sent: DemandCounts | None = None
        self._sent_at = float("-inf")

    def served(self, tokens: int, retry: bool = False) -> None:
        """One request served: `tokens` its prompt + max_tokens; `retry`: the client said it is a
        retry of one refused before."""
        c = self._counts
        self._counts = replace(c, served_tokens=c.served_tokens + tokens, served_requests=c.served_requests + 1,
                               retried_tokens=c.retried_tokens + tokens * retry)

    def refused(self, tokens: int | None = None, retry: bool = False) -> None:
        """One request refused: `tokens` its prompt + max_tokens, None when its size is unknown."""
        c = self._counts
        self._counts = replace(c, refused_tokens=c.refused_tokens + (tokens or 0),
                               refused_unsized=c.refused_unsized + (tokens is None),
                               retried_tokens=c.retried_tokens + (tokens or 0) * retry)

    @property
    def counts(self) -> DemandCounts:
        return self._counts

    def to_send(self, now: float, unsized: int = 0) -> DemandCounts | None:
        """The counters when a report is due (moved, and REPORT_EVERY_S since the last), else None;
        the first call always sends (the controller's baseline). `unsized`: refusals of unknown
        size counted elsewhere (an in-flight limit's), added to the counter's own."""
        counts = replace(self._counts, refused_unsized=self._counts.refused_unsized + unsized)
        if self._sent is not None and (counts == self._sent or now - self._sent_at < REPORT_EVERY_S):
            return None
        self._sent, self._sent_at = counts, now
        return counts


class DemandLog:
    """Increments of served and refused demand, kept `window_s` seconds, read as rates."""

    def __init__(self, window_s: float, start_t: float = 0.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.start_t = start_t  # rates never cover time before the log began
        self._events: deque[tuple[float, DemandCounts]] = deque()
        self._counters: dict[str, DemandCounts] = {}  # source -> its last counters
        self._mean_tokens = 0.0  # a served request's size, lately (sizes the unsized refusals)

    def add(self, t: float, served: int = 0, refused: int = 0, counts: DemandCounts | None = None) -> None:
        """Demand at time `t` (times must not go backwards much): `served` / `refused` tokens of
        one request each, or the increments `counts`."""
        counts = counts or DemandCounts(served, 1 if served else 0, refused)
        if counts:
            self._events.append((t, counts))
        self._prune(t)

    def report(self, source: str, t: float, counts: DemandCounts) -> None:
        """A source's counters at `t`: their growth since its previous report is added (none
        from a report older than one already taken: relays may deliver them out of order)."""
        last = self._counters.get(source)
        if last is None:
            self._counters[source] = counts
            return
        counts = last.latest(counts)
        self._counters[source] = counts
        self.add(t, counts=counts - last)

    def forget(self, source: str) -> None:
        """The source went away (its increments stay in the window)."""
        self._counters.pop(source, None)

    def rates(self, now: float, since: float | None = None) -> tuple[float, float]:
        """(served, refused) tokens per second over (max(since, now - window_s, start), now].
        Refused is less the retried tokens (never below none): their refusal was counted once."""
        self._prune(now)
        start = max(now - self.window_s, self.start_t, since if since is not None else -float("inf"))
        span = now - start
        if span <= 0:
            return 0.0, 0.0
        served = requests = refused = unsized = 0
        for t, c in reversed(self._events):
            if t <= start:  # an increment covers the time before it: (start, now]
                break
            served += c.served_tokens
            requests += c.served_requests
            refused += c.refused_tokens - c.retried_tokens
            unsized += c.refused_unsized
        if requests > 0:
            self._mean_tokens = served / requests
        return served / span, max(0.0, refused + unsized * self._mean_tokens) / span

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        while events and events[0][0] < horizon:
            events.popleft()
