"""Overload and soak measurement: how the server sheds 10x its sustainable load, and recovers.

    python -m loadtests.overload --quick                       # smoke run, about 1-2 minutes
    python -m loadtests.overload                               # rate search, 10x for 60 s, recovery
    python -m loadtests.overload --rate 8 --factor 5           # skip the search
    python -m loadtests.overload --set replica.max_queued_tokens=4096 --queue-deadline-s 5
    python -m loadtests.overload --url http://127.0.0.1:8000 --server-pid 1234   # a running server
    python -m loadtests.overload --soak --soak-minutes 30 --soak-fraction 0.7
    python -m loadtests.overload --bursts 6 --burst-size 128    # bursts at once on a quiet server

Without `--url` it starts its own server (`loadtests/serve_local.py`, the `args:` of
`serve_config.yaml` plus every `--set key=value`) and stops it at the end. Phases:

1. warm-up: a few requests one at a time, the unloaded TTFT/TBT; the prompt length is calibrated
   so a prompt has about `--prompt-tokens` tokens.
2. sustainable: open-loop Poisson steps (fixed seed) of streaming `/v1/completions` requests
   (`max_tokens`, `ignore_eos`), the rate doubling from `--start-rate` (halving if the first step
   fails); the highest rate whose completed/offered >= `--keep-up`, with no 429 and p99 TTFT
   under `--ttft-bound-s`. `--rate R` measures one step at R instead. Then `--baseline-s` at that
   rate, as long as the overload: its p99 TBT is the overload's baseline (a search step's streams
   mostly run after its arrivals stopped; 0: the step's own).
3. overload (not with `--soak`): `--factor` x that rate for `--duration-s`. Per request: status,
   time to headers, TTFT, every inter-chunk gap, `[DONE]`, in-band error events, cut streams
   (ended without `[DONE]` and without an error event), 429 Retry-After / OpenAI error shape.
4. recovery: one probe (`--probe-max-tokens` long) every `--probe-interval-s` right after the
   overload; seconds until the probes are answered normally (200, TTFT <=
   `--recovery-ttft-factor` x unloaded) from then on.
5. RSS (every second, whole run) of the Ray workers titled `ray::ServeReplica:<app>:LLMServer`,
   `...:OpenAIIngress`, and the HTTP `ray::ProxyActor`: start (just before the overload), peak,
   and `--rss-after-s` after the overload ended.
`--soak`: `--soak-minutes` at `--soak-fraction` x the sustainable rate with a mixed workload
(short/long prompts and outputs, streaming or not, completions or chat); errors, RSS over time
and its least-squares slope in MB/min, and the engine's KV gauges after quiet when the Ray
metrics endpoint can be found (`--metrics-url`, or found from our server's dashboard agent),
else "unmeasured"; targets: no errors, slope <= `--rss-slope-mb-min`, no KV blocks or requests
held after quiet.

Latencies count from each request's scheduled send time (open loop: the arrival generator never
waits for responses, so a server or client that falls behind is measured, not hidden). The load
generator stands in for clients on other machines, so on a machine it shares with the server it
keeps its own cost and wait small: aiohttp (a C HTTP parser: with httpx, a 10x overload's ~1,000
streamed chunks a second saturated its event loop and its 429 p99 read 9-50 s where curl, beside
it, saw under 0.3 s) and, once the server is up, CPU niceness `--client-nice` (-10; when the OS
allows it). Its event loop's own lag is reported. During the overload a second client, the door
probe, sends one small request every `--door-probe-interval-s` from its own process, on a new
connection each: the 429 latency is judged by it too. TBT is
what the client sees: events that arrive in one network read have a gap of 0. Every request is
bounded by `--timeout-s` (its own category). Prints the targets with PASS/MISS (n/a: nothing to
judge, e.g. no 429 at all) and writes everything to `--json`; the server's log lands next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from app.stream_limit import watch_loop
from loadtests import metrics_text, serve_local
from loadtests.arrivals import poisson_window
from loadtests.stats import percentile

SERVE_CONFIG = Path(__file__).resolve().parents[1] / "serve_config.yaml"
GROUPS = ("LLMServer", "OpenAIIngress", "ProxyActor")
MB = 1024 * 1024
# Plain words for prompts; the warm-up measures how many tokens a word is for the served model.
WORDS = tuple(
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city name team minute idea kid body back parent face level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education".split())
STATUS_PASS, STATUS_MISS, STATUS_NA = "PASS", "MISS", "n/a"
GAUGE_SETTLE_S = 25.0  # re-read busy engine gauges this long (Ray exports every ~10 s)
CATEGORIES = ("ok", "429", "5xx", "4xx", "cut", "error_event", "timeout", "transport_error",
              "abandoned")


# ---- requests and records --------------------------------------------------------------------


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
    status: int | None = None
    headers_s: float | None = None
    ttft_s: float | None = None
    end_s: float | None = None
    gaps: list[float] = field(default_factory=list)
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
            ("as many as it found keep their streams' gaps", "proxy: stream cap"),
            ("it refused a request moments ago", "proxy: hold"),
            ("requests are in flight at this proxy", "proxy: in-flight limit"),
            ("requests are in flight at this ingress", "ingress: in-flight limit"),
            ("the replicas' queues take", "ingress: token gate"),
            ("without reaching a model replica", "ingress: queue deadline"),
            ("the replica's queue is full", "replica: queue bound"),
            ("without being scheduled", "replica: queue deadline"))


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


def random_text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), max(1, n_words)))


def completion_spec(model: str, prompt: str, max_tokens: int, stream: bool = True,
                    kind: str = "cmpl") -> ReqSpec:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "temperature": 0}
    return ReqSpec("/v1/completions", json.dumps(body).encode(), stream, kind)


def chat_spec(model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool,
              kind: str = "chat") -> ReqSpec:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "temperature": 0}
    return ReqSpec("/v1/chat/completions", json.dumps(body).encode(), stream, kind)


def uniform_specs(rng: np.random.Generator, n: int, model: str, words: int,
                  max_tokens: int) -> list[ReqSpec]:
    """`n` streaming completions, each its own random prompt of `words` words."""
    return [completion_spec(model, random_text(rng, words), max_tokens) for _ in range(n)]


def soak_spec(rng: np.random.Generator, model: str, words_per_token: float) -> ReqSpec:
    """One request of the soak mix: 80% short / 20% long prompts, 70% short / 30% long outputs,
    half streaming, half chat (a third of the chats with three turns)."""
    long_prompt = rng.random() < 0.2
    tokens = int(rng.integers(512, 1025) if long_prompt else rng.integers(16, 193))
    words = max(1, round(tokens * words_per_token))
    max_tokens = int(rng.integers(128, 257) if rng.random() < 0.3 else rng.integers(8, 65))
    stream = bool(rng.random() < 0.5)
    label = f"{'long' if long_prompt else 'short'}-{'stream' if stream else 'whole'}"
    if rng.random() < 0.5:
        return completion_spec(model, random_text(rng, words), max_tokens, stream, f"cmpl-{label}")
    if rng.random() < 1 / 3:
        third = max(1, words // 3)
        messages = [{"role": "user", "content": random_text(rng, third)},
                    {"role": "assistant", "content": random_text(rng, third)},
                    {"role": "user", "content": random_text(rng, third)}]
    else:
        messages = [{"role": "user", "content": random_text(rng, words)}]
    return chat_spec(model, messages, max_tokens, stream, f"chat-{label}")


# ---- statistics -------------------------------------------------------------------------------


def counts(recs: Sequence[Rec]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for r in recs:
        out[classify(r)] += 1
    return out


def accepted_ttfts(recs: Sequence[Rec]) -> list[float]:
    """TTFT of every 200; one that never got a first token counts with how long it waited."""
    out: list[float] = []
    for r in recs:
        if r.status == 200:
            t = r.ttft_s if r.ttft_s is not None else r.end_s
            if t is not None:
                out.append(t)
    return out


def refusals_by_source(rejected: Sequence[Rec]) -> dict[str, dict[str, Any]]:
    """Per bound that answered: how many 429s, their latency p50 / p99 / max."""
    groups: dict[str, list[float]] = {}
    for r in rejected:
        if r.headers_s is not None:
            groups.setdefault(r.refused_by or "other", []).append(r.headers_s)
    return {who: {"n": len(lat), "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
                  "max_s": max(lat)} for who, lat in sorted(groups.items(), key=lambda kv: -len(kv[1]))}


def summarize(recs: Sequence[Rec], window_s: float) -> dict[str, Any]:
    """Counts by category, latencies of accepted requests, and what the rejections looked like."""
    by = counts(recs)
    gaps = [g for r in recs if r.status == 200 for g in r.gaps]
    ttft = accepted_ttfts(recs)
    rejected = [r for r in recs if r.status == 429]
    non200 = [r for r in recs if r.status is not None and r.status != 200]
    lat429 = [r.headers_s for r in rejected if r.headers_s is not None]
    return {
        "sent": len(recs), "window_s": window_s,
        "offered_req_s": len(recs) / window_s if window_s > 0 else 0.0,
        "counts": by, "completed_ratio": by["ok"] / len(recs) if recs else 0.0,
        "accepted": sum(r.status == 200 for r in recs),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft, default=None),
        "tbt_p50_s": percentile(gaps, 50), "tbt_p99_s": percentile(gaps, 99),
        "tbt_max_s": max(gaps, default=None), "num_gaps": len(gaps),
        "headers_200_p99_s": percentile([r.headers_s for r in recs
                                         if r.status == 200 and r.headers_s is not None], 99),
        "reject_p50_s": percentile(lat429, 50), "reject_p99_s": percentile(lat429, 99),
        "reject_max_s": max(lat429, default=None),
        "reject_by": refusals_by_source(rejected),
        "reject_retry_after": sum(bool(r.retry_after) for r in rejected),
        "reject_openai_body": sum(bool(r.openai_body) for r in rejected),
        "non_json_error_bodies": sum(r.json_body is False for r in non200),
        "non_openai_error_bodies": sum(not r.openai_body for r in non200),
        "status_codes": _status_codes(recs),
        "transport_errors": _transport_errors(recs),
    }


def _status_codes(recs: Sequence[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        key = str(r.status) if r.status is not None else "none"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _transport_errors(recs: Sequence[Rec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r.exc:
            out[r.exc] = out.get(r.exc, 0) + 1
    return out


def step_verdict(s: dict[str, Any], keep_up: float, ttft_bound_s: float) -> tuple[bool, str]:
    """Does one rate-search step count as sustainable? (and why not)."""
    if s["sent"] == 0:
        return False, "no requests"
    if s["counts"]["429"]:
        return False, f"{s['counts']['429']} x 429"
    if s["completed_ratio"] < keep_up:
        return False, f"completed {s['completed_ratio']:.0%} < {keep_up:.0%}"
    if s["ttft_p99_s"] is None or s["ttft_p99_s"] > ttft_bound_s:
        return False, f"p99 TTFT above {ttft_bound_s:g} s"
    return True, "ok"


def next_rate(history: Sequence[tuple[float, bool]], start: float, max_steps: int,
              max_rate: float, min_rate: float = 0.125) -> float | None:
    """The next rate to try: double after a pass, stop at the first failure after a pass; halve
    while nothing passed. None when the search is over."""
    if not history:
        return start
    if len(history) >= max_steps:
        return None
    rate, ok = history[-1]
    if ok:  # up, unless that rate (or one below it) already failed
        up = rate * 2
        failed_below = any(not passed and r <= up for r, passed in history)
        return up if up <= max_rate and not failed_below else None
    if any(passed for _, passed in history):
        return None
    return rate / 2 if rate / 2 >= min_rate else None


def sustainable_rate(history: Sequence[tuple[float, bool]]) -> float | None:
    passed = [rate for rate, ok in history if ok]
    return max(passed) if passed else None


def recovery_seconds(probes: Sequence[tuple[float, bool, float | None]]) -> float | None:
    """Seconds after the overload until normal service: the first probe from which every later
    probe is normal, at the moment it was answered (its send offset + TTFT). `probes` are
    (send offset, normal?, TTFT) in send order; None if the last probe is not normal."""
    first_good: tuple[float, bool, float | None] | None = None
    for probe in probes:
        if not probe[1]:
            first_good = None
        elif first_good is None:
            first_good = probe
    if first_good is None:
        return None
    return first_good[0] + (first_good[2] or 0.0)


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against ts (seconds), per minute; None under 2 distinct ts."""
    if len(ts) < 2 or max(ts) == min(ts):
        return None
    t = np.asarray(ts, dtype=float)
    y = np.asarray(ys, dtype=float)
    t = t - t.mean()
    return float(60.0 * (t * (y - y.mean())).sum() / (t * t).sum())


Sample = tuple[float, dict[str, int]]  # (monotonic time, {group: RSS bytes summed over processes})


def rss_slopes(samples: Sequence[Sample], t0: float, t1: float) -> dict[str, float | None]:
    """Each group's RSS slope (MB/min) over the samples taken in [t0, t1]."""
    slopes: dict[str, float | None] = {}
    for group in GROUPS:
        pts = [(ts, rss[group] / MB) for ts, rss in samples if group in rss and t0 <= ts <= t1]
        slopes[group] = slope_per_min([p[0] for p in pts], [p[1] for p in pts])
    return slopes


def rss_at(samples: Sequence[Sample], t: float, group: str) -> int | None:
    """The group's RSS in the last sample at or before `t` (else the first after it)."""
    best: int | None = None
    for ts, rss in samples:
        if group not in rss:
            continue
        if ts <= t or best is None:
            best = rss[group]
        if ts > t:
            break
    return best


def rss_report(samples: Sequence[Sample], group: str, t_start: float, t_end: float,
               after_s: float, tolerance: float) -> dict[str, Any]:
    """Start (at t_start), peak (from t_start on), and RSS `after_s` after t_end, in MB."""
    start = rss_at(samples, t_start, group)
    after = rss_at(samples, t_end + after_s, group)
    peak = max((rss[group] for ts, rss in samples if ts >= t_start and group in rss), default=None)
    ratio = after / start if start and after is not None else None
    mb = lambda v: None if v is None else round(v / MB, 1)  # noqa: E731
    return {"start_mb": mb(start), "peak_mb": mb(peak), "after_mb": mb(after), "after_s": after_s,
            "after_over_start": ratio,
            "within": None if ratio is None else ratio <= 1 + tolerance}


# ---- targets and tables ----------------------------------------------------------------------


Target = dict[str, str]


def target(name: str, measured: str, ok: bool | None) -> Target:
    status = STATUS_NA if ok is None else (STATUS_PASS if ok else STATUS_MISS)
    return {"target": name, "measured": measured, "status": status}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f} ms"


def overload_targets(ov: dict[str, Any], baseline_tbt_p99_s: float | None,
                     recovery_s: float | None, rss: dict[str, dict[str, Any]],
                     cfg: dict[str, float], probe: dict[str, Any] | None = None) -> list[Target]:
    """The overload targets; `cfg` holds the bounds (see `parse_args`); `probe`: the door
    probe's `probe_summary` (the 429 latency judged a second time, by a client not loaded)."""
    c, n429 = ov["counts"], ov["counts"]["429"]
    rows = [target("0 responses 5xx", str(c["5xx"]), c["5xx"] == 0),
            target("0 streams cut without an error event", str(c["cut"]), c["cut"] == 0),
            target(f"0 client timeouts ({cfg['timeout_s']:g} s)", str(c["timeout"]), c["timeout"] == 0),
            target("0 non-JSON error bodies", str(ov["non_json_error_bodies"]),
                   ov["non_json_error_bodies"] == 0),
            target(f"429 p99 latency < {_ms(cfg['reject_p99_s'])}",
                   f"{_ms(ov['reject_p99_s'])} ({n429} x 429)",
                   None if not n429 else ov["reject_p99_s"] < cfg["reject_p99_s"])]
    if probe is not None:
        rows.append(target(f"429 p99 latency < {_ms(cfg['reject_p99_s'])} (door probe)",
                           f"{_ms(probe['reject_p99_s'])} ({probe['n429']} x 429)",
                           None if not probe["n429"] else probe["reject_p99_s"] < cfg["reject_p99_s"]))
    rows += [target("every 429 has Retry-After", f"{ov['reject_retry_after']}/{n429}",
                   None if not n429 else ov["reject_retry_after"] == n429),
            target("every 429 body in OpenAI error shape", f"{ov['reject_openai_body']}/{n429}",
                   None if not n429 else ov["reject_openai_body"] == n429)]
    tbt = ov["tbt_p99_s"]
    bound = None if baseline_tbt_p99_s is None else cfg["tbt_factor"] * baseline_tbt_p99_s
    rows.append(target(f"accepted p99 TBT <= {cfg['tbt_factor']:g} x sustainable ({_ms(baseline_tbt_p99_s)})",
                       _ms(tbt), None if tbt is None or bound is None else tbt <= bound))
    ttft = ov["ttft_p99_s"]
    rows.append(target(f"accepted p99 TTFT < queue deadline {cfg['queue_deadline_s']:g} s", _ms(ttft),
                       None if ttft is None else ttft < cfg["queue_deadline_s"]))
    for group, rep in rss.items():
        measured = (f"{rep['start_mb']} -> peak {rep['peak_mb']} -> {rep['after_mb']} MB"
                    if rep["start_mb"] is not None else "unmeasured (no process found)")
        rows.append(target(f"{group} RSS within {cfg['rss_tolerance']:.0%} of start "
                           f"{rep['after_s']:g} s after", measured, rep["within"]))
    rows.append(target(f"normal service within {cfg['recovery_target_s']:g} s",
                       "never (in the probe window)" if recovery_s is None else f"{recovery_s:.1f} s",
                       recovery_s is not None and recovery_s <= cfg["recovery_target_s"]))
    return rows


def format_targets(rows: Sequence[Target]) -> str:
    w1 = max([len("target")] + [len(r["target"]) for r in rows])
    w2 = max([len("measured")] + [len(r["measured"]) for r in rows])
    lines = [f"{'target':<{w1}}  {'measured':<{w2}}  result", "-" * (w1 + w2 + 10)]
    lines += [f"{r['target']:<{w1}}  {r['measured']:<{w2}}  {r['status']}" for r in rows]
    return "\n".join(lines)


STEP_HEADER = (f"{'req/s':>7}{'sent':>6}{'ok':>6}{'429':>5}{'5xx':>5}{'cut':>5}{'t/o':>5}"
               f"{'open':>5}{'TTFT99':>8}{'TBT99':>7}  verdict   (ms)")


def format_step(rate: float, s: dict[str, Any], verdict: str) -> str:
    c = s["counts"]
    ms = lambda v: "-" if v is None else f"{1e3 * v:.0f}"  # noqa: E731
    return (f"{rate:>7.2f}{s['sent']:>6}{c['ok']:>6}{c['429']:>5}{c['5xx']:>5}{c['cut']:>5}"
            f"{c['timeout']:>5}{c['abandoned']:>5}{ms(s['ttft_p99_s']):>8}{ms(s['tbt_p99_s']):>7}"
            f"  {verdict}")


def format_phase(name: str, s: dict[str, Any]) -> str:
    c = s["counts"]
    return "\n".join([
        f"{name}: {s['sent']} sent over {s['window_s']:.1f} s ({s['offered_req_s']:.1f} req/s); "
        + ", ".join(f"{k} {v}" for k, v in c.items() if v),
        f"  accepted {s['accepted']}: TTFT p50 {_ms(s['ttft_p50_s'])} p99 {_ms(s['ttft_p99_s'])}"
        f" max {_ms(s['ttft_max_s'])}; TBT p50 {_ms(s['tbt_p50_s'])} p99 {_ms(s['tbt_p99_s'])}"
        f" max {_ms(s['tbt_max_s'])}",
        f"  429 latency p50 {_ms(s['reject_p50_s'])} p99 {_ms(s['reject_p99_s'])}; "
        f"status codes {s['status_codes']}"
        + (f"; transport errors {s['transport_errors']}" if s["transport_errors"] else ""),
        *(f"    429 from {who}: {g['n']}, p50 {_ms(g['p50_s'])} p99 {_ms(g['p99_s'])} max {_ms(g['max_s'])}"
          for who, g in s.get("reject_by", {}).items())])


def compact(rec: Rec) -> dict[str, Any]:
    """One request for the JSON (without its gaps)."""
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {"kind": rec.kind, "sched_s": r(rec.sched_s), "category": classify(rec),
            "status": rec.status, "headers_s": r(rec.headers_s), "ttft_s": r(rec.ttft_s),
            "end_s": r(rec.end_s), "chunks": rec.chunks, "max_gap_s": r(max(rec.gaps, default=None)),
            "worst_gap_at_s": r(rec.worst_gap_at_s),
            "exc": rec.exc, "refused_by": rec.refused_by}


# ---- Prometheus gauges (the engine's KV state) -------------------------------------------------


ENGINE_GAUGES = ("ray_stallfree_kv_cache_usage_perc", "ray_stallfree_num_requests_running",
                 "ray_stallfree_num_requests_waiting", "ray_stallfree_token_load")


def engine_gauges(text: str) -> dict[str, float]:
    """The engine gauges of LLMServer replicas: KV usage as the max over replicas, others summed."""
    out: dict[str, float] = {}
    for name, labels, value in metrics_text.samples(text, ENGINE_GAUGES):
        if labels.get("deployment", "LLMServer") != "LLMServer":
            continue
        name = name.removeprefix("ray_stallfree_")
        merge = max if name == "kv_cache_usage_perc" else (lambda a, b: a + b)
        out[name] = merge(out[name], value) if name in out else value
    return out


# ---- server processes: RSS ---------------------------------------------------------------------


def group_of(cmdline: str) -> str | None:
    """The RSS group of a process by its title (`ray::ServeReplica:llm:LLMServer`), or None."""
    if "ServeReplica:" in cmdline:
        for group in ("LLMServer", "OpenAIIngress"):
            if f":{group}" in cmdline:
                return group
        return None
    return "ProxyActor" if "ray::ProxyActor" in cmdline else None


def _procs_psutil(root_pid: int | None) -> list[tuple[int, str, int]]:
    import psutil
    try:
        procs = (psutil.Process(root_pid).children(recursive=True) if root_pid is not None
                 else list(psutil.process_iter()))
    except psutil.Error:
        return []
    out: list[tuple[int, str, int]] = []
    for p in procs:
        try:
            out.append((p.pid, " ".join(p.cmdline()), p.memory_info().rss))
        except psutil.Error:
            continue
    return out


def _procs_proc(root_pid: int | None) -> list[tuple[int, str, int]]:
    """The same from /proc (no psutil): (pid, cmdline, rss bytes), descendants of root_pid."""
    info: dict[int, tuple[int, str, int]] = {}  # pid -> (ppid, cmdline, rss)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            base = f"/proc/{entry}"
            cmd = Path(base, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(base, "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            rss = int(stat.rsplit(")", 1)[1].split()[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        info[int(entry)] = (ppid, cmd, rss)
    if root_pid is None:
        return [(pid, cmd, rss) for pid, (_, cmd, rss) in info.items()]
    keep, frontier = set(), {root_pid}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in info.items() if ppid in frontier} - keep
        keep |= frontier
    return [(pid, info[pid][1], info[pid][2]) for pid in keep]


def server_processes(root_pid: int | None) -> list[tuple[int, str, int]]:
    """(pid, cmdline, RSS bytes) of the server's processes (all processes without a root)."""
    try:
        import psutil  # noqa: F401 - psutil when the venv has it, /proc otherwise
    except ImportError:
        return _procs_proc(root_pid)
    return _procs_psutil(root_pid)


class RssSampler:
    """A thread that sums the RSS of each group's processes about every `interval_s`."""

    def __init__(self, root_pid: int | None, interval_s: float = 1.0) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self.samples: list[Sample] = []
        self.pids: dict[str, set[int]] = {g: set() for g in GROUPS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def sample_once(self) -> Sample:
        rss: dict[str, int] = {}
        for pid, cmd, value in server_processes(self.root_pid):
            group = group_of(cmd)
            if group is not None:
                rss[group] = rss.get(group, 0) + value
                self.pids[group].add(pid)
        return time.monotonic(), rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample_once())
            self._stop.wait(self.interval_s)

    def series(self, t0: float, step_s: float = 10.0) -> dict[str, list[tuple[float, float]]]:
        """Every group's (seconds since t0, MB), one point per `step_s` (for the JSON)."""
        out: dict[str, list[tuple[float, float]]] = {g: [] for g in GROUPS}
        last: dict[str, float] = {}
        for ts, rss in list(self.samples):
            for g, v in rss.items():
                if ts - last.get(g, -math.inf) >= step_s:
                    out[g].append((round(ts - t0, 1), round(v / MB, 1)))
                    last[g] = ts
        return {g: pts for g, pts in out.items() if pts}


def find_metrics_url(root_pid: int | None) -> str | None:
    """Ray's Prometheus endpoint of our server: a listening port of its dashboard agent that
    answers /metrics (needs psutil and a known server process)."""
    try:
        import psutil
    except ImportError:
        return None
    if root_pid is None:
        return None
    for pid, cmd, _ in server_processes(root_pid):
        if "DashboardAgent" not in cmd and "dashboard/agent.py" not in cmd:
            continue
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for conn in conns:
            if conn.status != psutil.CONN_LISTEN:
                continue
            url = f"http://127.0.0.1:{conn.laddr.port}/metrics"
            try:
                r = httpx.get(url, timeout=3)
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and "ray_" in r.text:
                return url
    return None


# ---- client ---------------------------------------------------------------------------------


STALL_S = 0.1  # the load generator's loop woke this late: its gaps then include it (kept with times)

HEADERS = {"Content-Type": "application/json"}


async def _read_stream(resp: aiohttp.ClientResponse, rec: Rec, t_sched: float) -> None:
    """Consume an SSE body: TTFT, every gap between content chunks, [DONE], error events."""
    buf, last, worst = b"", None, -1.0
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        events, buf = split_events(buf + piece)
        for event in events:
            kind = sse_kind(event)
            if kind == "content":
                if last is None:
                    rec.ttft_s = now - t_sched
                else:
                    if now - last > worst:
                        worst, rec.worst_gap_at_s = now - last, rec.sched_s + now - t_sched
                    rec.gaps.append(now - last)
                last = now
                rec.chunks += 1
            elif kind == "done":
                rec.done = True
            elif kind == "error":
                rec.error_event = True


async def _read_whole(resp: aiohttp.ClientResponse, rec: Rec, t_sched: float) -> None:
    """A non-streaming 200: done when it is a JSON answer with choices."""
    body = await resp.read()
    rec.ttft_s = time.perf_counter() - t_sched
    try:
        data = json.loads(body)
    except ValueError:
        return
    rec.error_event = isinstance(data, dict) and "error" in data
    rec.done = isinstance(data, dict) and bool(data.get("choices"))


async def _read_error(resp: aiohttp.ClientResponse, rec: Rec) -> None:
    rec.retry_after = "retry-after" in resp.headers
    body = await resp.read()
    try:
        data = json.loads(body)
    except ValueError:
        rec.json_body, rec.openai_body = False, False
        return
    rec.json_body, rec.openai_body = True, is_openai_error(data)
    if rec.status == 429 and rec.openai_body:
        rec.refused_by = refuser(str(data["error"].get("message", "")))


async def _exchange(client: aiohttp.ClientSession, spec: ReqSpec, rec: Rec, t_sched: float) -> None:
    async with client.post(spec.path, data=spec.payload, headers=HEADERS) as resp:
        rec.status = resp.status
        rec.headers_s = time.perf_counter() - t_sched
        if resp.status != 200:
            await _read_error(resp, rec)
        elif spec.stream:
            await _read_stream(resp, rec, t_sched)
        else:
            await _read_whole(resp, rec, t_sched)


async def send(client: aiohttp.ClientSession, spec: ReqSpec, rec: Rec, t_sched: float,
               timeout_s: float) -> Rec:
    """One request, filled into `rec`; the whole exchange is bounded by `timeout_s`."""
    try:
        await asyncio.wait_for(_exchange(client, spec, rec, t_sched), timeout_s)
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


async def open_loop(client: aiohttp.ClientSession, specs: Sequence[ReqSpec], offsets: Sequence[float],
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
        max_lag = max(max_lag, time.perf_counter() - t0 - off)
        rec = Rec(spec.kind, off)
        recs.append(rec)
        tasks.append(asyncio.create_task(send(client, spec, rec, t0 + off, timeout_s)))
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


def probe_summary(samples: Sequence[tuple[float, int | None, float]]) -> dict[str, Any]:
    """The door probe's answers: how many of each status, the 429s' latency p50 / p99 / max."""
    lat429 = [lat for _, status, lat in samples if status == 429]
    codes = Counter(str(status) for _, status, _ in samples)
    return {"sent": len(samples), "status_codes": dict(codes), "n429": len(lat429),
            "reject_p50_s": percentile(lat429, 50), "reject_p99_s": percentile(lat429, 99),
            "reject_max_s": max(lat429, default=None)}


def lag_summary(samples: Sequence[float]) -> dict[str, float | None]:
    return {"p50_s": percentile(samples, 50), "p99_s": percentile(samples, 99),
            "max_s": max(samples, default=None)}


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


async def sequential(client: aiohttp.ClientSession, specs: Sequence[ReqSpec], timeout_s: float) -> list[Rec]:
    """Requests one after another (unloaded latencies)."""
    out: list[Rec] = []
    for spec in specs:
        t = time.perf_counter()
        out.append(await send(client, spec, Rec(spec.kind, 0.0), t, timeout_s))
    return out


# ---- phases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    """What every phase needs."""

    client: aiohttp.ClientSession
    base: str  # the server's URL
    model: str
    args: argparse.Namespace
    words: int  # prompt words for about --prompt-tokens tokens
    tokens_per_word: float


async def calibrate(client: aiohttp.ClientSession, base: str, model: str, args: argparse.Namespace) -> Ctx:
    """Tokens per prompt word of the served model (one non-streaming request's usage)."""
    rng = np.random.default_rng(args.seed + 999)
    spec = completion_spec(model, random_text(rng, 100), 1, stream=False)
    async with client.post(spec.path, data=spec.payload, headers=HEADERS) as resp:
        resp.raise_for_status()
        per_word = (await resp.json())["usage"]["prompt_tokens"] / 100
    return Ctx(client, base, model, args, max(1, round(args.prompt_tokens / per_word)), per_word)


async def warm_up(ctx: Ctx) -> dict[str, Any]:
    """Unloaded latencies: requests one at a time (the first pays first-call costs, dropped)."""
    rng = np.random.default_rng(ctx.args.seed + 998)
    specs = uniform_specs(rng, 4, ctx.model, ctx.words, ctx.args.max_tokens)
    recs = (await sequential(ctx.client, specs, ctx.args.timeout_s))[1:]
    bad = [classify(r) for r in recs if classify(r) != "ok"]
    if bad:
        raise RuntimeError(f"warm-up requests failed on an idle server: {bad}")
    s = summarize(recs, 0.0)
    e2e = percentile([r.end_s for r in recs if r.end_s is not None], 50) or 0.0
    return {"prompt_words": ctx.words, "tokens_per_word": round(ctx.tokens_per_word, 3),
            "prompt_tokens_est": round(ctx.words * ctx.tokens_per_word),
            "max_tokens": ctx.args.max_tokens, "ttft_p50_s": s["ttft_p50_s"],
            "tbt_p50_s": s["tbt_p50_s"], "tbt_p99_s": s["tbt_p99_s"], "e2e_p50_s": e2e}


async def run_step(ctx: Ctx, rate: float, seed: int, grace_s: float, seconds: float | None = None,
                   desc: str = "search") -> dict[str, Any]:
    """`seconds` (a search step's `--step-s` unless given) of Poisson arrivals at `rate`, then at
    most `grace_s` for them to finish."""
    seconds = ctx.args.step_s if seconds is None else seconds
    offsets = poisson_window(rate, seconds, seed)
    specs = uniform_specs(np.random.default_rng(seed), len(offsets), ctx.model, ctx.words,
                          ctx.args.max_tokens)
    with tqdm(total=len(specs), desc=f"{desc} {rate:g} req/s", unit="req", leave=False) as bar:
        run = await open_loop(ctx.client, specs, offsets, ctx.args.timeout_s, bar)
        await drain(run, grace_s)
    return summarize(run.recs, seconds)


async def bursts(ctx: Ctx, count: int, size: int, pause_s: float) -> dict[str, Any]:
    """`count` bursts of `size` streaming requests sent at once to an idle server, each after
    the last has ended and `pause_s` of quiet: what a batch job or a retry storm does. The
    server has the capacity (the burst fits `max_num_seqs` and the queue); it should take them."""
    per_burst: list[dict[str, Any]] = []
    for k in range(count):
        await asyncio.sleep(pause_s)
        specs = uniform_specs(np.random.default_rng(ctx.args.seed + 500 + k), size, ctx.model,
                              ctx.words, ctx.args.max_tokens)
        with tqdm(total=size, desc=f"burst {k + 1}/{count}", unit="req", leave=False) as bar:
            run = await open_loop(ctx.client, specs, [0.0] * size, ctx.args.timeout_s, bar)
            await drain(run, None)
        s = summarize(run.recs, 0.0)
        per_burst.append({"counts": s["counts"], "ttft_p99_s": s["ttft_p99_s"],
                          "e2e_max_s": max((r.end_s or 0.0) for r in run.recs),
                          "reject_by": {who: g["n"] for who, g in s["reject_by"].items()}})
        tqdm.write(f"burst {k + 1}: {size} at once: " + ", ".join(f"{c} {n}" for c, n in s["counts"].items() if n)
                   + f"; TTFT p99 {_ms(s['ttft_p99_s'])}"
                   + "".join(f"; 429 from {who}: {n}" for who, n in per_burst[-1]["reject_by"].items()))
    total = {c: sum(b["counts"][c] for b in per_burst) for c in CATEGORIES}
    return {"count": count, "size": size, "pause_s": pause_s, "bursts": per_burst, "counts": total}


def finish_grace_s(warm: dict[str, Any]) -> float:
    """How long a step's last requests get to finish after its arrivals: 3 unloaded requests' time."""
    return max(2.0, 3.0 * warm["e2e_p50_s"])


async def search(ctx: Ctx, warm: dict[str, Any]) -> dict[str, Any]:
    """The sustainable rate (see the module doc); `--rate` measures that one rate instead."""
    a = ctx.args
    grace = finish_grace_s(warm)
    history: list[tuple[float, bool]] = []
    steps: list[dict[str, Any]] = []
    tqdm.write(f"rate search: {a.step_s:g} s steps, then up to {grace:.1f} s to finish\n{STEP_HEADER}")
    rate: float | None = a.rate or a.start_rate
    while rate is not None:
        s = await run_step(ctx, rate, a.seed + len(steps), grace)
        ok, why = step_verdict(s, a.keep_up, a.ttft_bound_s)
        history.append((rate, ok))
        steps.append({"rate": rate, "pass": ok, "verdict": why, **s})
        tqdm.write(format_step(rate, s, why))
        await asyncio.sleep(1.0 if ok else a.settle_s)  # let a failed step's backlog clear
        rate = None if a.rate else next_rate(history, a.start_rate, a.max_steps, a.max_rate)
    best = a.rate or sustainable_rate(history)
    found = bool(a.rate) or best is not None
    if best is None:  # nothing kept up: use the gentlest rate tried, and say so
        best = min(r for r, _ in history)
    base = next(st for st in steps if st["rate"] == best)
    return {"steps": steps, "sustainable_req_s": best, "found": found, "given": bool(a.rate),
            "baseline_tbt_p99_s": base["tbt_p99_s"], "baseline_ttft_p99_s": base["ttft_p99_s"]}


async def steady(ctx: Ctx, rate: float, warm: dict[str, Any]) -> dict[str, Any]:
    """`--baseline-s` of Poisson arrivals at the sustainable rate: the full-load quality the
    overload's accepted requests are held to, measured as long as the overload runs. A search
    step is too short for it: a 10 s step's 256-token streams run ~15 s, so most of their gaps
    come while its arrivals have already stopped and the load falls."""
    a = ctx.args
    s = await run_step(ctx, rate, a.seed + 100, finish_grace_s(warm), a.baseline_s, "steady")
    ok, why = step_verdict(s, a.keep_up, a.ttft_bound_s)
    return {"rate": rate, "seconds": a.baseline_s, "pass": ok, "verdict": why, **s}


def with_steady_baseline(found: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    """The search's result with its baselines taken from the steady phase `st` (the search
    step's own kept as `search_tbt_p99_s` / `search_ttft_p99_s`)."""
    return {**found, "steady": st, "search_tbt_p99_s": found["baseline_tbt_p99_s"],
            "search_ttft_p99_s": found["baseline_ttft_p99_s"],
            "baseline_tbt_p99_s": st["tbt_p99_s"], "baseline_ttft_p99_s": st["ttft_p99_s"]}


async def recovery(ctx: Ctx, unloaded_ttft_s: float) -> dict[str, Any]:
    """Probes every `--probe-interval-s` for `--recovery-s`, from right after the overload."""
    a = ctx.args
    n = int(a.recovery_s / a.probe_interval_s) + 1
    offsets = [i * a.probe_interval_s for i in range(n)]
    # Short answers: a probe asks whether a new request is served normally again, and probes of
    # --max-tokens each (2 a second of 256-token streams) were on a slow day an overload of their own.
    specs = uniform_specs(np.random.default_rng(a.seed + 3000), n, ctx.model, ctx.words,
                          min(a.max_tokens, a.probe_max_tokens))
    with tqdm(total=n, desc="recovery probes", unit="req", leave=False) as bar:
        run = await open_loop(ctx.client, specs, offsets, a.timeout_s, bar)
        await drain(run, None)
    bound = a.recovery_ttft_factor * unloaded_ttft_s
    probes = [(r.sched_s, classify(r) == "ok" and r.ttft_s is not None and r.ttft_s <= bound, r.ttft_s)
              for r in run.recs]
    return {"normal_ttft_bound_s": bound, "recovery_s": recovery_seconds(probes),
            "probes": [{"sent_s": round(t, 2), "normal": ok, "category": classify(r),
                        "status": r.status, "ttft_s": None if tt is None else round(tt, 4)}
                       for (t, ok, tt), r in zip(probes, run.recs)]}


async def overload(ctx: Ctx, rate: float, warm: dict[str, Any]) -> dict[str, Any]:
    """`--duration-s` at `rate`, then the recovery probes while the overload's requests drain."""
    a = ctx.args
    offsets = poisson_window(rate, a.duration_s, a.seed + 1000)
    specs = uniform_specs(np.random.default_rng(a.seed + 1000), len(offsets), ctx.model, ctx.words,
                          a.max_tokens)
    loop = asyncio.get_running_loop()
    probe_body = completion_spec(ctx.model, "hello there", 1, stream=False).payload
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        await loop.run_in_executor(pool, door_probe, ctx.base, probe_body, 0.0, -1.0, 1.0, 1.0)  # started
        probe = loop.run_in_executor(pool, door_probe, ctx.base, probe_body, time.time(), a.duration_s,
                                     a.door_probe_interval_s, a.timeout_s)
        lag: list[float] = []  # how late this loop wakes from a 50 ms sleep: every latency includes it
        stalls: list[tuple[float, float]] = []  # (seconds into the phase, lag) of the late wakes

        def woke(late_s: float) -> None:
            lag.append(late_s)
            if late_s > STALL_S:
                stalls.append((round(time.monotonic() - t_start, 2), round(late_s, 3)))

        t_start, started_at = time.monotonic(), time.strftime("%H:%M:%S")
        watcher = asyncio.create_task(watch_loop(woke, time.perf_counter, tick_s=0.05))
        with tqdm(total=len(specs), desc=f"overload {rate:g} req/s", unit="req", leave=False) as bar:
            run = await open_loop(ctx.client, specs, offsets, a.timeout_s, bar)
        t_end = time.monotonic()
        watcher.cancel()
        rec_task = asyncio.create_task(recovery(ctx, warm["ttft_p50_s"]))
        await drain(run, None)  # every request is bounded by --timeout-s
        drained_after_s = time.monotonic() - t_end
        rec = await rec_task
        probes = await probe
    wait = t_end + a.rss_after_s + 1.5 - time.monotonic()
    if wait > 0:
        tqdm.write(f"waiting {wait:.0f} s for the RSS sample {a.rss_after_s:g} s after the overload")
        await asyncio.sleep(wait)
    return {"rate_req_s": rate, "t_start": t_start, "t_end": t_end, "started_at": started_at,
            "summary": summarize(run.recs, a.duration_s), "recovery": rec,
            "client_max_lag_s": round(run.max_lag_s, 3), "client_loop_lag": lag_summary(lag),
            "client_loop_stalls": stalls,
            "door_probe": probe_summary(probes), "door_probe_samples": probes,
            "drained_after_s": round(drained_after_s, 1),
            "requests": [compact(r) for r in run.recs]}


async def soak(ctx: Ctx, rate: float, sampler: RssSampler, root_pid: int | None) -> dict[str, Any]:
    """`--soak-minutes` of the mixed workload at `rate`; errors, RSS slopes, KV state after."""
    a = ctx.args
    duration = 60.0 * a.soak_minutes
    offsets = poisson_window(rate, duration, a.seed + 2000)
    rng = np.random.default_rng(a.seed + 2000)
    specs = [soak_spec(rng, ctx.model, 1.0 / ctx.tokens_per_word) for _ in offsets]
    t_start = time.monotonic()
    with tqdm(total=len(specs), desc=f"soak {rate:.2f} req/s", unit="req") as bar:
        run = await open_loop(ctx.client, specs, offsets, a.timeout_s, bar)
    t_end = time.monotonic()
    await drain(run, None)
    tqdm.write(f"soak sent; waiting {a.quiet_s:g} s of quiet before reading the engine's gauges")
    await asyncio.sleep(a.quiet_s)
    kinds = sorted({r.kind for r in run.recs})
    by_kind = {k: counts([r for r in run.recs if r.kind == k]) for k in kinds}
    # A leak grows for the whole soak; warm-up (allocator pools, caches filling to their bounds)
    # grows early and levels off. The target is read on the second half; the whole is reported.
    whole = rss_slopes(sampler.samples, t_start + a.soak_warmup_s, t_end)
    late = rss_slopes(sampler.samples, (t_start + t_end) / 2, t_end)
    rss = {g: rss_report(sampler.samples, g, t_start, t_end, a.quiet_s, a.rss_tolerance) for g in GROUPS}
    return {"rate_req_s": rate, "duration_s": duration, "t_start": t_start, "t_end": t_end,
            "summary": summarize(run.recs, duration), "by_kind": by_kind,
            "client_max_lag_s": round(run.max_lag_s, 3),
            "rss_slope_mb_per_min": whole, "rss_late_slope_mb_per_min": late, "rss": rss,
            "engine": await engine_state(a, root_pid), "health": await health(ctx.client)}


async def engine_state(args: argparse.Namespace, root_pid: int | None) -> dict[str, Any]:
    """The engine's gauges from Ray's Prometheus endpoint, or why they are unmeasured.

    Ray exports a replica's metrics about every 10 s, so a reading that still shows running or
    waiting requests is read again every 2 s for up to GAUGE_SETTLE_S: a stale export clears,
    a stuck request does not."""
    url = args.metrics_url or await asyncio.to_thread(find_metrics_url, root_pid)
    if not url:
        return {"measured": False, "why": "no Ray metrics endpoint found (pass --metrics-url)"}
    deadline = time.monotonic() + GAUGE_SETTLE_S
    readings: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            try:
                gauges = engine_gauges((await c.get(url)).text)
            except httpx.HTTPError as exc:
                return {"measured": False, "why": f"{url}: {type(exc).__name__}", "url": url}
            readings.append(gauges)
            busy = gauges.get("num_requests_running", 0) or gauges.get("num_requests_waiting", 0)
            if not gauges or not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(2.0)
    if not gauges:
        return {"measured": False, "why": f"{url} has no stallfree gauges", "url": url}
    return {"measured": True, "url": url, "readings": len(readings), **gauges}


async def health(client: aiohttp.ClientSession) -> int | None:
    try:
        async with client.get("/health", timeout=aiohttp.ClientTimeout(total=15)) as resp:
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def soak_targets(sk: dict[str, Any], cfg: dict[str, float]) -> list[Target]:
    c = sk["summary"]["counts"]
    errors = sk["summary"]["sent"] - c["ok"]
    rows = [target("0 errors (anything but a complete 200)", str(errors), errors == 0),
            target("0 streams cut without an error event", str(c["cut"]), c["cut"] == 0)]
    for group, slope in sk["rss_late_slope_mb_per_min"].items():
        whole = sk["rss_slope_mb_per_min"].get(group)
        rows.append(target(f"{group} RSS slope, 2nd half <= {cfg['rss_slope_mb_min']:g} MB/min",
                           "unmeasured" if slope is None else
                           f"{slope:+.2f} MB/min (whole {'-' if whole is None else f'{whole:+.2f}'})",
                           None if slope is None else slope <= cfg["rss_slope_mb_min"]))
    eng = sk["engine"]
    for key, name in (("kv_cache_usage_perc", "KV cache usage 0 after quiet"),
                      ("num_requests_running", "0 requests running after quiet"),
                      ("num_requests_waiting", "0 requests waiting after quiet")):
        value = eng.get(key)
        rows.append(target(name, "unmeasured" if value is None else f"{value:g}",
                           None if value is None else value == 0))
    rows.append(target("healthy after the soak", str(sk["health"]), sk["health"] == 200))
    return rows


# ---- the run ----------------------------------------------------------------------------------


def serve_config_args(path: Path = SERVE_CONFIG) -> dict[str, Any]:
    """The `args:` of the first application in serve_config.yaml ({} if it cannot be read)."""
    try:
        import yaml
        apps = yaml.safe_load(path.read_text()).get("applications") or [{}]
        return dict(apps[0].get("args") or {})
    except Exception:  # noqa: BLE001 - no yaml, no file: the AppArgs defaults
        return {}


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
    """(base URL, root pid of the server's processes, app args): `--url`, or one we start."""
    if args.url:
        if args.sets:
            tqdm.write("note: --set is ignored with --url")
        yield args.url.rstrip("/"), args.server_pid, {}
        return
    app_args = serve_local.merge_args(serve_config_args(), serve_local.parse_sets(args.sets))
    port = serve_local.free_port()
    base = f"http://127.0.0.1:{port}"
    log = args.json.parent / "overload_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    tqdm.write(f"starting the server on {base} (log: {log}) with {app_args}")
    proc = serve_local.launch(port, app_args, log_path=str(log))
    try:
        serve_local.wait_healthy(base, proc, timeout_s=600)
        yield base, proc.pid, app_args
    finally:
        tqdm.write("stopping the server")
        serve_local.stop(proc)


def bounds(args: argparse.Namespace) -> dict[str, float]:
    keys = ("timeout_s", "reject_p99_s", "tbt_factor", "queue_deadline_s", "rss_tolerance",
            "recovery_target_s", "rss_slope_mb_min")
    return {k: getattr(args, k) for k in keys}


async def run_all(args: argparse.Namespace, base: str, root_pid: int | None,
                  sampler: RssSampler, result: dict[str, Any]) -> None:
    """Every phase in order; `result` is filled as they finish (so a crash keeps what ran)."""
    # aiohttp, not httpx: its C parser costs the load generator a fraction of the CPU per
    # streamed chunk, and on a machine it shares with the server its own lag is measured too.
    connector = aiohttp.TCPConnector(limit=args.max_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
    result["client_nice"] = raise_priority(args.client_nice) if args.client_nice else None
    async with aiohttp.ClientSession(base_url=base, connector=connector, timeout=timeout) as client:
        async with client.get("/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        ctx = await calibrate(client, base, model, args)
        result["model"] = model
        result["warm_up"] = warm = await warm_up(ctx)
        tqdm.write(f"model {model}: prompts of {ctx.words} words (~{warm['prompt_tokens_est']} tokens), "
                   f"max_tokens {args.max_tokens}; unloaded TTFT {_ms(warm['ttft_p50_s'])}, "
                   f"TBT p50 {_ms(warm['tbt_p50_s'])}")
        if args.bursts:
            result["bursts"] = b = await bursts(ctx, args.bursts, args.burst_size, args.burst_pause_s)
            result["targets"] = [target(f"0 of {b['count']} x {b['size']} burst requests refused",
                                        f"{b['counts']['429']} x 429, {b['counts']['ok']} ok",
                                        b["counts"]["ok"] == b["count"] * b["size"])]
            result["report"] = format_targets(result["targets"])
            return
        result["search"] = found = await search(ctx, warm)
        rate = found["sustainable_req_s"]
        tqdm.write(f"sustainable: {rate:g} req/s" + ("" if found["found"] else
                   " (NOT found: even the lowest rate tried failed; using it)")
                   + f"; its p99 TBT {_ms(found['baseline_tbt_p99_s'])}")
        if args.baseline_s > 0 and not args.soak:
            st = await steady(ctx, rate, warm)
            result["search"] = found = with_steady_baseline(found, st)
            tqdm.write(format_step(rate, st, st["verdict"])
                       + f"\nsteady state: {rate:g} req/s for {args.baseline_s:g} s; its p99 TBT "
                       f"{_ms(st['tbt_p99_s'])} (the overload's baseline)")
        if args.soak:
            await run_soak(ctx, args, rate, sampler, root_pid, result)
        else:
            await run_overload(ctx, args, rate, found, sampler, result)


async def run_overload(ctx: Ctx, args: argparse.Namespace, rate: float, found: dict[str, Any],
                       sampler: RssSampler, result: dict[str, Any]) -> None:
    ov = await overload(ctx, args.factor * rate, result["warm_up"])
    t_start, t_end = ov.pop("t_start"), ov.pop("t_end")
    rss = {g: rss_report(sampler.samples, g, t_start, t_end, args.rss_after_s, args.rss_tolerance)
           for g in GROUPS}
    result["overload"] = ov
    result["rss"] = {"groups": rss, "pids": {g: sorted(p) for g, p in sampler.pids.items()},
                     "series_mb": sampler.series(t_start)}
    result["health_after"] = await health(ctx.client)
    result["targets"] = overload_targets(ov["summary"], found["baseline_tbt_p99_s"],
                                         ov["recovery"]["recovery_s"], rss, bounds(args), ov["door_probe"])
    lag, probe = ov["client_loop_lag"], ov["door_probe"]
    notes = (f"  client fell behind its schedule by at most {ov['client_max_lag_s']:.3f} s; its event loop "
             f"woke late by p50 {_ms(lag['p50_s'])} p99 {_ms(lag['p99_s'])} max {_ms(lag['max_s'])} "
             f"(niceness {result.get('client_nice')}); the overload's requests all ended "
             f"{ov['drained_after_s']:g} s after the last send; /health after: {result['health_after']}\n"
             f"  door probe (a second client, its own process, one request every "
             f"{args.door_probe_interval_s:g} s): {probe['status_codes']}; 429 latency p50 "
             f"{_ms(probe['reject_p50_s'])} p99 {_ms(probe['reject_p99_s'])} max {_ms(probe['reject_max_s'])}")
    result["report"] = "\n\n".join([format_phase(f"overload x{args.factor:g}", ov["summary"]) + "\n"
                                    + notes, format_targets(result["targets"])])


async def run_soak(ctx: Ctx, args: argparse.Namespace, rate: float, sampler: RssSampler,
                   root_pid: int | None, result: dict[str, Any]) -> None:
    sk = await soak(ctx, args.soak_fraction * rate, sampler, root_pid)
    t_start = sk.pop("t_start")
    sk.pop("t_end")
    sk["series_mb"] = sampler.series(t_start, step_s=10.0)
    result["soak"] = sk
    result["targets"] = soak_targets(sk, bounds(args))
    lines = [format_phase(f"soak x{args.soak_fraction:g}", sk["summary"])]
    lines += [f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in c.items() if v)
              for kind, c in sk["by_kind"].items()]
    result["report"] = "\n".join(lines) + "\n\n" + format_targets(result["targets"])


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


QUICK = {"step_s": 3.0, "max_steps": 2, "duration_s": 10.0, "baseline_s": 5.0, "recovery_s": 5.0,
         "rss_after_s": 5.0, "soak_minutes": 1.0, "settle_s": 2.0, "quiet_s": 5.0, "soak_warmup_s": 5.0}
DEFAULTS = {"step_s": 10.0, "max_steps": 6, "duration_s": 60.0, "baseline_s": 60.0, "recovery_s": 30.0,
            "rss_after_s": 30.0, "soak_minutes": 30.0, "settle_s": 5.0, "quiet_s": 15.0,
            "soak_warmup_s": 60.0}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those name their normal and quick values themselves)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action) or ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.overload", description=__doc__.split("\n")[0],
                                formatter_class=_Help)
    f, i = float, int
    add = p.add_argument
    q = QUICK

    def by_mode(flag: str, kind: type, text: str) -> None:
        """An option whose default depends on --quick (DEFAULTS and QUICK say which)."""
        key = flag[2:].replace("-", "_")
        add(flag, type=kind, help=f"{text} (default {DEFAULTS[key]:g}; quick {q[key]:g})")

    add("--quick", action="store_true", help=f"smoke run: {q['max_steps']} search steps of {q['step_s']:g} s, "
        f"{q['duration_s']:g} s overload, {q['recovery_s']:g} s recovery and RSS wait, "
        f"{q['soak_minutes']:g} min soak (explicit options still win)")
    add("--url", help="use this running server instead of starting one")
    add("--server-pid", type=i, help="with --url: RSS only of this process's descendants")
    add("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="an app.args.AppArgs field for the server we start (repeatable)")
    add("--json", type=Path, default=Path("loadtests/out/overload.json"),
        help="results (the server's log goes next to it)")
    add("--seed", type=i, default=0, help="workload seed (arrivals and prompts)")
    add("--prompt-tokens", type=i, default=64, help="prompt length (random words, calibrated)")
    add("--max-tokens", type=i, default=64, help="output tokens (ignore_eos)")
    add("--timeout-s", type=f, default=120.0, help="per-request limit; beyond it: timeout")
    add("--max-connections", type=i, default=2000, help="client connection pool")
    add("--rate", type=f, help="the sustainable rate, req/s: skip the search (one step measures it)")
    add("--start-rate", type=f, default=2.0, help="first search step, req/s")
    add("--max-rate", type=f, default=256.0, help="the search stops above it")
    by_mode("--max-steps", i, "rate-search steps")
    by_mode("--step-s", f, "seconds per search step")
    add("--keep-up", type=f, default=0.95, help="sustainable: completed/offered at least this")
    add("--ttft-bound-s", type=f, default=2.0, help="sustainable: p99 TTFT under this")
    by_mode("--settle-s", f, "pause after a failed step")
    add("--factor", type=f, default=10.0, help="overload = factor x sustainable")
    by_mode("--duration-s", f, "overload seconds")
    by_mode("--baseline-s", f, "seconds at the sustainable rate whose p99s are the overload's "
            "baseline (0: the search step's)")
    by_mode("--recovery-s", f, "seconds of recovery probes")
    add("--probe-interval-s", type=f, default=0.5, help="recovery probe spacing")
    add("--probe-max-tokens", type=i, default=16, help="recovery probes' output tokens (at most --max-tokens)")
    add("--recovery-ttft-factor", type=f, default=5.0, help="normal: TTFT <= this x unloaded")
    add("--recovery-target-s", type=f, default=5.0, help="target: normal service within this")
    by_mode("--rss-after-s", f, "RSS sample this long after the overload")
    add("--rss-tolerance", type=f, default=0.2, help="target: RSS after <= (1 + this) x start")
    add("--reject-p99-s", type=f, default=0.5, help="target: 429 p99 latency under this")
    add("--door-probe-interval-s", type=f, default=0.25,
        help="overload: the door probe's spacing (a second client in its own process)")
    add("--client-nice", type=i, default=-10, help="the load generator's CPU niceness once the "
        "server is up (negative needs privileges; 0 leaves it)")
    add("--tbt-factor", type=f, default=1.5, help="target: accepted p99 TBT <= this x sustainable's")
    add("--queue-deadline-s", type=f, default=10.0, help="target: accepted p99 TTFT under this")
    add("--bursts", type=i, default=0, help="instead of the rate search and overload: this many "
        "bursts of --burst-size streams at once, each on a quiet server")
    add("--burst-size", type=i, default=128, help="requests per burst")
    add("--burst-pause-s", type=f, default=1.0, help="quiet before each burst")
    add("--soak", action="store_true", help="soak instead of overload")
    by_mode("--soak-minutes", f, "soak length")
    add("--soak-fraction", type=f, default=0.7, help="soak rate = this x sustainable")
    by_mode("--soak-warmup-s", f, "RSS slope ignores the soak's first seconds")
    add("--rss-slope-mb-min", type=f, default=1.0, help="soak target: RSS slope at most this")
    by_mode("--quiet-s", f, "quiet after the soak before the KV gauges")
    add("--metrics-url", help="Ray's Prometheus /metrics (default: found from our server)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()},
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "machine": f"{os.cpu_count()} CPUs"}
    try:
        with server(args) as (base, root_pid, app_args):
            result["server"] = {"url": base, "root_pid": root_pid, "app_args": app_args}
            sampler = RssSampler(root_pid).start()
            try:
                asyncio.run(run_all(args, base, root_pid, sampler, result))
            finally:
                sampler.stop()
    finally:
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_json(args.json, result)
    print("\n" + result.get("report", "(no report)"))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
