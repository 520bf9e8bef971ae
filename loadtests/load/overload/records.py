"""What one request of the overload test is (`ReqSpec`) and what it did (`Rec`), and how an
answer is classified: ok, 429 (and which bound refused it), 5xx, 4xx, cut, error event, timeout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("ok", "429", "5xx", "4xx", "cut", "error_event", "timeout", "transport_error",
              "abandoned")


@dataclass(frozen=True)
class ReqSpec:
    """One request to send: endpoint, pre-encoded JSON body, whether it streams, a label."""

    path: str
    payload: bytes
    stream: bool
    kind: str = "cmpl"


@dataclass
class Rec:
    """What one request did; every time is seconds from its scheduled send time."""

    kind: str
    sched_s: float  # scheduled send offset from the start of its phase
    send_lag_s: float = 0.0  # how late the generator sent it: every latency below includes this
    status: int | None = None
    headers_s: float | None = None
    headers_arrival_s: float | None = None  # the same, when the head's bytes reached the kernel
    ttft_s: float | None = None
    end_s: float | None = None
    gaps: list[float] = field(default_factory=list)  # between content events, as the client read them
    arrival_gaps: list[float] = field(default_factory=list)  # the same, as their bytes reached the kernel
    worst_gap_at_s: float | None = None  # when the longest gap ended, from the start of its phase
    chunks: int = 0
    done: bool = False  # `data: [DONE]` (streams) / a complete JSON answer (non-streaming)
    error_event: bool = False  # an in-band `data: {"error": ...}` event
    timed_out: bool = False
    abandoned: bool = False  # cancelled by us at the end of a rate-search step
    exc: str | None = None  # transport error (connect refused, reset, ...)
    retry_after: bool | None = None  # non-200: a Retry-After header
    json_body: bool | None = None  # non-200: the body parses as JSON
    openai_body: bool | None = None  # non-200: {"error": {"message","type","param","code"}}
    refused_by: str | None = None  # a 429: which of the server's bounds answered (`refuser`)


# Which bound a 429 came from, by the words its message starts with (app/ and replicas/ errors).
REFUSERS = (("the requests before this one wait", "proxy: queueing"),
            ("the streams it serves already arrive slowly", "proxy: slow streams"),
            ("to reach the ingress", "proxy: slow hop"),
            ("as many as it found keep their streams' gaps", "proxy: stream cap"),
            ("it refused a request moments ago", "proxy: hold"),
            ("as many as the server has lately taken without refusing", "proxy: unanswered window"),
            ("requests are in flight at this proxy", "proxy: in-flight limit"),
            ("requests are in flight at this ingress", "ingress: in-flight limit"),
            ("the replicas' queues take", "ingress: token gate"),
            ("without reaching a model replica", "ingress: queue deadline"),
            ("the replica's queue is full", "replica: queue bound"),
            ("without being scheduled", "replica: queue deadline"),
            ("it would not be scheduled within", "replica: predicted past deadline"))


def refuser(message: str) -> str:
    """The bound a 429's message names ("other" for anything else, e.g. Serve's own)."""
    return next((who for words, who in REFUSERS if words in message), "other")


def classify(rec: Rec) -> str:
    """One of CATEGORIES; "cut" is a 200 stream that ended without [DONE] and without an error."""
    if rec.abandoned:
        return "abandoned"
    if rec.timed_out:
        return "timeout"
    if rec.status is None:
        return "transport_error"
    if rec.status == 200:
        if rec.error_event:
            return "error_event"
        return "ok" if rec.done else "cut"
    if rec.status == 429:
        return "429"
    return "5xx" if rec.status >= 500 else "4xx"


def is_openai_error(body: Any) -> bool:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}` (all four keys)."""
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str) and "param" in err and "code" in err)


def compact(rec: Rec) -> dict[str, Any]:
    """One request for the JSON (without its gaps)."""
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {"kind": rec.kind, "sched_s": r(rec.sched_s), "category": classify(rec),
            "status": rec.status, "headers_s": r(rec.headers_s), "ttft_s": r(rec.ttft_s),
            "end_s": r(rec.end_s), "chunks": rec.chunks, "max_gap_s": r(max(rec.gaps, default=None)),
            "worst_gap_at_s": r(rec.worst_gap_at_s),
            "exc": rec.exc, "refused_by": rec.refused_by}
