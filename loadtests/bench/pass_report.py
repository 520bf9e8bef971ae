"""Read a replica's pass trace (`pass_trace_dir`, replicas/serving/pass_trace.py): how its passes ran.

    python -m loadtests.bench.pass_report loadtests/out/sweep/passes_stall_free+slo/passes-*.jsonl --slo-ms 1000

Prints the passes' durations, how far each ran from its prediction (actual / predicted, by
predicted length: the passes near the SLO target are the ones whose overruns become gaps over
the SLO), the CPU time the process got against the wall time (well under 1 with one torch
thread: the pass waited for a core), and every pass with decodes that ran over the SLO (a gap
over the SLO for every stream in it). `--json` writes the same as one object.

`--min-seqs N --stream-interval-ms MS` adds the cadence of the span where passes ran N or more
sequences (a full batch under overload): pass durations and their ratio to prediction, the time
between landings, and the gaps between a running stream's chunks if its deltas go out at the
landings `outputs.merged_due` picks for that interval: what the engine alone makes of a client's
TBT (a client measuring more adds the HTTP path and its own lateness).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Predicted pass length, as a share of the SLO: the buckets the ratio table reports.
BUCKETS = ((0.05, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 1.0), (1.0, float("inf")))


def load(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return sorted(rows, key=lambda r: r["time"])


def report(rows: Sequence[dict[str, Any]], slo_s: float) -> dict[str, Any]:
    """The trace summarized against a TBT SLO of `slo_s` seconds."""
    if not rows:
        return {"passes": 0}
    t0 = rows[0]["time"]
    dur = np.array([r["duration_s"] for r in rows])
    cpu = np.array([r["cpu_s"] if r.get("cpu_s") is not None else np.nan for r in rows])
    pred = np.array([r["predicted_s"] if r.get("predicted_s") else np.nan for r in rows])
    ratios = []
    for lo, hi in BUCKETS:
        m = (pred >= lo * slo_s) & (pred < hi * slo_s)
        if m.any():
            r = dur[m] / pred[m]
            ratios.append({"predicted_share_of_slo": [lo, hi], "passes": int(m.sum()),
                           "ratio_p50": float(np.median(r)), "ratio_p90": float(np.percentile(r, 90)),
                           "ratio_max": float(r.max())})
    over = [{"at_s": round(r["time"] - t0, 3), "duration_s": r["duration_s"], "cpu_s": r.get("cpu_s"),
             "predicted_s": r.get("predicted_s"), "pass_target_s": r.get("pass_target_s"),
             "prefill_tokens": r["prefill_tokens"], "decode_tokens": r["decode_tokens"]}
            for r in rows if r["decode_tokens"] > 0 and r["duration_s"] > slo_s]
    busy = float(dur.sum())
    return {"passes": len(rows), "span_s": round(rows[-1]["time"] + rows[-1]["duration_s"] - t0, 3),
            "busy_s": busy, "duration_p50_s": float(np.median(dur)),
            "duration_p99_s": float(np.percentile(dur, 99)), "duration_max_s": float(dur.max()),
            "prefill_tokens_per_busy_s": sum(r["prefill_tokens"] for r in rows) / busy if busy else 0.0,
            "cpu_per_wall": float(np.nansum(cpu) / busy) if busy and not np.isnan(cpu).all() else None,
            "ratio_by_predicted": ratios, "over_slo_with_decodes": over}


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=float)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def cadence(rows: Sequence[dict[str, Any]], min_seqs: int, interval_s: float) -> dict[str, Any] | None:
    """Over the span from the first to the last pass of `min_seqs` sequences or more: their
    durations and ratios to prediction, the time between landings (every pass's), and the gaps
    between one running stream's chunks, sent at the landings `merged_due` picks."""
    from replicas.outputs import merged_due

    full = [r for r in rows if r["sequences"] >= min_seqs]
    if len(full) < 2:
        return None
    span = [r for r in rows if full[0]["time"] <= r["time"] <= full[-1]["time"]]
    landed = [r["time"] + r["duration_s"] for r in span]
    gaps, sent, before = [], landed[0], landed[0]
    for at in landed[1:]:
        if sent <= merged_due(at, before, interval_s):
            gaps.append(at - sent)
            sent = at
        before = at
    ratios = [r["duration_s"] / r["predicted_s"] for r in full if r.get("predicted_s")]
    return {"min_seqs": min_seqs, "passes": len(full), "span_s": landed[-1] - landed[0],
            "duration_s": percentiles([r["duration_s"] for r in full]),
            "actual_over_predicted": percentiles(ratios) if ratios else None,
            "landing_interval_s": percentiles(np.diff(landed)), "stream_interval_s": interval_s,
            "chunk_gap_s": percentiles(gaps) if gaps else None}


def format_cadence(c: dict[str, Any] | None) -> str:
    if c is None:
        return "no span of full passes"

    def ms(p: dict[str, float] | None) -> str:
        return "-" if p is None else " / ".join(f"{1e3 * p[k]:.1f}" for k in ("p50", "p90", "p99"))

    ratio = c["actual_over_predicted"]
    ratio_text = "-" if ratio is None else " / ".join(f"{ratio[k]:.2f}" for k in ("p50", "p90", "p99"))
    return (f"passes of {c['min_seqs']}+ sequences: {c['passes']} over {c['span_s']:.0f} s; duration p50 / p90 / p99 "
            f"{ms(c['duration_s'])} ms; actual / predicted {ratio_text}; landings every {ms(c['landing_interval_s'])} "
            f"ms; a stream's chunks at {1e3 * c['stream_interval_s']:g} ms merging: gaps {ms(c['chunk_gap_s'])} ms")


def format_report(rep: dict[str, Any], slo_s: float) -> str:
    if not rep["passes"]:
        return "no passes"
    cpu = rep["cpu_per_wall"]
    lines = [f"{rep['passes']} passes over {rep['span_s']:.0f} s, busy {rep['busy_s']:.1f} s; duration "
             f"p50 {1e3 * rep['duration_p50_s']:.0f} / p99 {1e3 * rep['duration_p99_s']:.0f} / max "
             f"{1e3 * rep['duration_max_s']:.0f} ms; {rep['prefill_tokens_per_busy_s']:.0f} prompt tokens "
             f"per busy s; CPU / wall {'-' if cpu is None else f'{cpu:.2f}'}",
             "", f"{'predicted (x SLO)':<18}{'passes':>7}{'p50':>7}{'p90':>7}{'max':>7}   actual / predicted"]
    for b in rep["ratio_by_predicted"]:
        lo, hi = b["predicted_share_of_slo"]
        label = f"{lo:g}-{hi:g}" if hi != float("inf") else f">= {lo:g}"
        lines.append(f"{label:<18}{b['passes']:>7}{b['ratio_p50']:>7.2f}{b['ratio_p90']:>7.2f}{b['ratio_max']:>7.2f}")
    over = rep["over_slo_with_decodes"]
    lines += ["", f"passes with decodes over the {1e3 * slo_s:.0f} ms SLO: {len(over)}"]
    for o in over:
        pred = "-" if o["predicted_s"] is None else f"{1e3 * o['predicted_s']:.0f}"
        target = "-" if o["pass_target_s"] is None else f"{1e3 * o['pass_target_s']:.0f}"
        cpu_ms = "-" if o["cpu_s"] is None else f"{1e3 * o['cpu_s']:.0f}"
        lines.append(f"  at {o['at_s']:8.1f} s: {1e3 * o['duration_s']:.0f} ms (CPU {cpu_ms}), predicted "
                     f"{pred}, target {target}; {o['prefill_tokens']} prompt + {o['decode_tokens']} decode tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.pass_report", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="passes-<pid>.jsonl files (one replica's, or several)")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="the TBT SLO the passes are judged by")
    p.add_argument("--json", type=Path, help="write the report here too")
    p.add_argument("--min-seqs", type=int, help="add the cadence of the span of passes with this many "
                   "sequences or more")
    p.add_argument("--stream-interval-ms", type=float, default=50.0, help="the merging the cadence replays")
    args = p.parse_args(argv)
    slo_s = args.slo_ms / 1000
    rows = load(args.paths)
    rep = report(rows, slo_s)
    print(format_report(rep, slo_s))
    if args.min_seqs is not None:
        rep["cadence"] = cadence(rows, args.min_seqs, args.stream_interval_ms / 1000)
        print("\n" + format_cadence(rep["cadence"]))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2) + "\n")
    return rep


if __name__ == "__main__":
    main()
