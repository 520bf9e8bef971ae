"""The targets (PASS / MISS / n/a) and the tables the overload test prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

STATUS_PASS, STATUS_MISS, STATUS_NA = "PASS", "MISS", "n/a"
Target = dict[str, str]


def target(name: str, measured: str, ok: bool | None) -> Target:
    status = STATUS_NA if ok is None else (STATUS_PASS if ok else STATUS_MISS)
    return {"target": name, "measured": measured, "status": status}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f} ms"


def overload_targets(ov: dict[str, Any], baseline_tbt_p99_s: float | None,
                     recovery_s: float | None, rss: dict[str, dict[str, Any]],
                     cfg: dict[str, float], probe: dict[str, Any] | None = None,
                     baseline_arrival_p99_s: float | None = None) -> list[Target]:
    """The overload targets; `cfg` holds the bounds (see `parse_args`); `probe`: the door
    probe's `probe_summary` (the 429 latency judged a second time, by a client not loaded);
    `baseline_arrival_p99_s`: the sustainable rate's TBT p99 on arrival (kernel receive times),
    against which the overload's on arrival is judged too (the server's gaps without the load
    generator's own lag)."""
    c, n429 = ov["counts"], ov["counts"]["429"]
    rows = [target("0 responses 5xx", str(c["5xx"]), c["5xx"] == 0),
            target("0 streams cut without an error event", str(c["cut"]), c["cut"] == 0),
            target(f"0 client timeouts ({cfg['timeout_s']:g} s)", str(c["timeout"]), c["timeout"] == 0),
            target("0 non-JSON error bodies", str(ov["non_json_error_bodies"]),
                   ov["non_json_error_bodies"] == 0),
            target(f"429 p99 latency < {ms(cfg['reject_p99_s'])}",
                   f"{ms(ov['reject_p99_s'])} ({n429} x 429)",
                   None if not n429 else ov["reject_p99_s"] < cfg["reject_p99_s"])]
    arrival = ov.get("reject_arrival_p99_s")
    if arrival is not None:
        rows.append(target(f"429 p99 latency on arrival < {ms(cfg['reject_p99_s'])}", f"{ms(arrival)} ({n429} x 429)",
                           arrival < cfg["reject_p99_s"]))
    if probe is not None:
        rows.append(target(f"429 p99 latency < {ms(cfg['reject_p99_s'])} (door probe)",
                           f"{ms(probe['reject_p99_s'])} ({probe['n429']} x 429)",
                           None if not probe["n429"] else probe["reject_p99_s"] < cfg["reject_p99_s"]))
    rows += [target("every 429 has Retry-After", f"{ov['reject_retry_after']}/{n429}",
                   None if not n429 else ov["reject_retry_after"] == n429),
            target("every 429 body in OpenAI error shape", f"{ov['reject_openai_body']}/{n429}",
                   None if not n429 else ov["reject_openai_body"] == n429)]
    tbt = ov["tbt_p99_s"]
    bound = None if baseline_tbt_p99_s is None else cfg["tbt_factor"] * baseline_tbt_p99_s
    rows.append(target(f"accepted p99 TBT <= {cfg['tbt_factor']:g} x sustainable ({ms(baseline_tbt_p99_s)})",
                       ms(tbt), None if tbt is None or bound is None else tbt <= bound))
    arr = ov.get("tbt_arrival_p99_s")
    if baseline_arrival_p99_s is not None:
        bound = cfg["tbt_factor"] * baseline_arrival_p99_s
        rows.append(target(f"accepted p99 TBT on arrival <= {cfg['tbt_factor']:g} x sustainable's "
                           f"({ms(baseline_arrival_p99_s)})", ms(arr), None if arr is None else arr <= bound))
    ttft = ov["ttft_p99_s"]
    rows.append(target(f"accepted p99 TTFT < queue deadline {cfg['queue_deadline_s']:g} s", ms(ttft),
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
        f"  accepted {s['accepted']}: TTFT p50 {ms(s['ttft_p50_s'])} p99 {ms(s['ttft_p99_s'])}"
        f" max {ms(s['ttft_max_s'])}; TBT p50 {ms(s['tbt_p50_s'])} p99 {ms(s['tbt_p99_s'])}"
        f" max {ms(s['tbt_max_s'])}; on arrival p50 {ms(s.get('tbt_arrival_p50_s'))}"
        f" p99 {ms(s.get('tbt_arrival_p99_s'))}",
        f"  429 latency p50 {ms(s['reject_p50_s'])} p99 {ms(s['reject_p99_s'])}; on arrival p50 "
        f"{ms(s.get('reject_arrival_p50_s'))} p99 {ms(s.get('reject_arrival_p99_s'))}; "
        f"status codes {s['status_codes']}"
        + (f"; transport errors {s['transport_errors']}" if s["transport_errors"] else ""),
        *(f"    429 from {who}: {g['n']}, p50 {ms(g['p50_s'])} p99 {ms(g['p99_s'])} max {ms(g['max_s'])}"
          for who, g in s.get("reject_by", {}).items())])


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


def run_row(name: str, s: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """One phase's line of the run table (a `summarize` result `s`): the 429s' latency, accepted
    TTFT / TBT p99 beside the sustainable rate's (`baseline`: the search's result), 5xx, cut
    streams, and how late the generator sent (its own cost on a machine it shares)."""
    c = s["counts"]
    base = baseline or {}
    return {"run": name, "offered_req_s": round(s["offered_req_s"], 2), "sent": s["sent"], "n429": c["429"],
            "reject_p50_s": s["reject_p50_s"], "reject_p99_s": s["reject_p99_s"],
            "ttft_p99_s": s["ttft_p99_s"], "sustainable_ttft_p99_s": base.get("baseline_ttft_p99_s"),
            "tbt_p99_s": s["tbt_p99_s"], "sustainable_tbt_p99_s": base.get("baseline_tbt_p99_s"),
            "tbt_arrival_p99_s": s.get("tbt_arrival_p99_s"),
            "sustainable_tbt_arrival_p99_s": base.get("baseline_tbt_arrival_p99_s"),
            "n5xx": c["5xx"], "cut": c["cut"],
            "send_lag_p50_s": s["send_lag_p50_s"], "send_lag_p99_s": s["send_lag_p99_s"]}


RUN_HEADER = (f"{'run':<12}{'req/s':>7}{'sent':>6}{'429':>6}{'429 p50':>8}{'429 p99':>8}{'TTFT99':>8}"
              f"{'sust.':>7}{'TBT99':>7}{'sust.':>7}{'arr99':>7}{'sust.':>7}{'5xx':>5}{'cut':>5}{'lag p50':>8}{'lag p99':>8}   (ms)")


def format_runs(rows: Sequence[dict[str, Any]]) -> str:
    """The run table: one line per phase (`run_row`); "sust." is the sustainable rate's p99;
    "arr99": TBT p99 on arrival (the kernel's receive times)."""
    n = lambda v: "-" if v is None else f"{1e3 * v:.0f}"  # noqa: E731
    lines = [RUN_HEADER]
    for r in rows:
        lines.append(f"{r['run']:<12}{r['offered_req_s']:>7.2f}{r['sent']:>6}{r['n429']:>6}"
                     f"{n(r['reject_p50_s']):>8}{n(r['reject_p99_s']):>8}{n(r['ttft_p99_s']):>8}"
                     f"{n(r['sustainable_ttft_p99_s']):>7}{n(r['tbt_p99_s']):>7}{n(r['sustainable_tbt_p99_s']):>7}"
                     f"{n(r['tbt_arrival_p99_s']):>7}{n(r['sustainable_tbt_arrival_p99_s']):>7}"
                     f"{r['n5xx']:>5}{r['cut']:>5}{n(r['send_lag_p50_s']):>8}{n(r['send_lag_p99_s']):>8}")
    return "\n".join(lines)
