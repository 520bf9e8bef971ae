"""`make loadtest`: a fixed-length headless Locust run against a running server, then a summary.

    python -m loadtests.load.loadtest --host http://127.0.0.1:8000 --duration 60s --rps 2 --out loadtests/out/

Locust runs in its own process (gevent and Ray do not share one) with `loadtests/load/locustfile.py`:
open-loop Poisson arrivals for `--duration`, then up to `--drain` more for the requests still
streaming. It writes `loadtest_stats.csv` (and Locust's other CSVs), `loadtest.html` and
`samples.jsonl` (one line per request) under `--out`; the summary (`summary.json`, also
printed) is computed from the samples, exactly, not from Locust's binned percentiles
(nearest-rank, `loadtests.harness.stats.percentile`: a p99 is an observed sample):

- TTFT p50/p99: send -> first content chunk. A request still waiting for its first token when
  the run ends counts with the time it waited (a lower bound), so overload is not hidden.
- TBT p50/p99/max: every gap between consecutive content chunks of every request, pooled.
- throughput: output tokens/s and finished requests/s over the window (first send -> last end).
- errors: HTTP errors, in-band error events, broken streams, wrong token counts.
- goodput: finished requests whose TTFT <= the TTFT SLO and whose every gap <= the TBT SLO,
  per second and as a share of the requests sent (`max_gap_slo_request_share`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.harness.mix import MixSpec
from loadtests.harness.report import OMIT, bench_parser
from loadtests.harness.stats import percentile
from loadtests.harness.workloads import PROMPT_SOURCES

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
PREFIX = "loadtest"
# SLO defaults for the embedded tiny model on CPU (the sweep sets its own for its model).
TTFT_SLO_MS = 2000.0
TBT_SLO_MS = 200.0


def parse_duration(text: str | float) -> float:
    """'60s', '2m', '1m30s', '90' -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    number = r"(\d+(?:\.\d+)?)"
    parts = re.fullmatch(rf"\s*(?:{number}h)?\s*(?:{number}m)?\s*(?:{number}s?)?\s*", text)
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 60s, 2m, 1m30s)")
    h, m, s = (float(g) if g else 0.0 for g in parts.groups())
    return 3600 * h + 60 * m + s


def run_locust(host: str, out_dir: Path, *, duration_s: float, drain_s: float, mix: MixSpec,
               ttft_slo_ms: float, tbt_slo_ms: float, model: str = "", prefix: str = PREFIX,
               quiet: bool = False, tick: Callable[[float], None] | None = None) -> Path:
    """Run Locust headless in a subprocess; returns the path of its per-request samples.

    `quiet` sends Locust's output to `<prefix>.log`; `tick(elapsed_s)` is called about once a
    second while it runs (progress bars).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = out_dir / f"{prefix}_samples.jsonl"
    run_time = int(np.ceil(duration_s + drain_s))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "1", "-r", "1",
           "--host", host, "--run-time", f"{run_time}s", "--drain-s", str(run_time - duration_s),
           "--csv", str(out_dir / prefix), "--html", str(out_dir / f"{prefix}.html"),
           "--samples-out", str(samples), "--only-summary", "--exit-code-on-error", "0",
           "--rps", str(mix.rps), "--prompt-median", str(mix.prompt_median),
           "--output-median", str(mix.output_median), "--long-share", str(mix.long_share),
           "--long-min", str(mix.long_min), "--long-max", str(mix.long_max),
           "--vocab-size", str(mix.vocab_size), "--seed", str(mix.seed), "--prompts", mix.prompts,
           "--ttft-slo-ms", str(ttft_slo_ms), "--tbt-slo-ms", str(tbt_slo_ms)]
    if model:
        cmd += ["--model", model]
    log = open(out_dir / f"{prefix}.log", "w") if quiet else None  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if quiet else None)
        start = time.monotonic()
        while proc.poll() is None:
            if tick is not None:
                tick(time.monotonic() - start)
            time.sleep(1.0)
    finally:
        if log is not None:
            log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"locust exited with code {proc.returncode}: {' '.join(cmd)}")
    return samples


def load_samples(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta record and the request records of a samples JSONL file."""
    meta: dict[str, Any] = {}
    reqs: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "meta":
            meta = rec
        elif rec.get("type") == "request":
            reqs.append(rec)
    return meta, reqs


def summarize(reqs: list[dict[str, Any]], ttft_slo_s: float, tbt_slo_s: float) -> dict[str, Any]:
    """Latency percentiles, throughput, errors and goodput of one run (see the module doc)."""
    ok = [r for r in reqs if not r["error"]]
    finished = [r for r in ok if r["finished"]]
    unfinished = [r for r in ok if not r["finished"]]
    ttft = [r["ttft_s"] if r["ttft_s"] is not None else r["end_s"] - r["start_s"] for r in ok]
    gaps = [g for r in ok for g in r["gaps_s"]]
    e2e = [r["e2e_s"] for r in finished]
    start = min((r["start_s"] for r in reqs), default=0.0)
    window = max((r["end_s"] for r in reqs), default=0.0) - start
    tokens = sum(r["completion_tokens"] for r in finished) + sum(r["num_chunks"] for r in unfinished)
    good = [r for r in finished
            if r["ttft_s"] <= ttft_slo_s and max(r["gaps_s"], default=0.0) <= tbt_slo_s]
    row: dict[str, Any] = {
        "requests": len(reqs), "finished": len(finished), "errors": len(reqs) - len(ok),
        "unfinished": len(unfinished), "window_s": window,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tbt_p50_s": percentile(gaps, 50), "tbt_p99_s": percentile(gaps, 99),
        "tbt_max_s": max(gaps) if gaps else None, "num_tbt": len(gaps),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tokens": tokens, "output_tok_s": tokens / window if window > 0 else 0.0,
        "req_s": len(finished) / window if window > 0 else 0.0,
        "ttft_slo_s": ttft_slo_s, "tbt_slo_s": tbt_slo_s, "good": len(good),
        "goodput_req_s": len(good) / window if window > 0 else 0.0,
        "max_gap_slo_request_share": len(good) / len(reqs) if reqs else 0.0,
    }
    for kind in sorted({r["kind"] for r in ok}):
        row[f"ttft_p50_{kind}_s"] = percentile([t for r, t in zip(ok, ttft) if r["kind"] == kind], 50)
    errors: dict[str, int] = {}
    for r in reqs:
        if r["error"]:
            key = r["error"][:120]
            errors[key] = errors.get(key, 0) + 1
    row["error_messages"] = errors
    return row


def format_summary(s: dict[str, Any]) -> str:
    ms = lambda v: "-" if v is None else f"{1e3 * v:.0f} ms"  # noqa: E731
    lines = [
        f"requests   {s['requests']} sent, {s['finished']} finished, {s['errors']} errors, "
        f"{s['unfinished']} unfinished, over {s['window_s']:.1f} s",
        f"TTFT       p50 {ms(s['ttft_p50_s'])}   p99 {ms(s['ttft_p99_s'])}"
        f"   (SLO {ms(s['ttft_slo_s'])})",
        f"TBT        p50 {ms(s['tbt_p50_s'])}   p99 {ms(s['tbt_p99_s'])}   max {ms(s['tbt_max_s'])}"
        f"   (SLO {ms(s['tbt_slo_s'])}; {s['num_tbt']} gaps)",
        f"E2E        p50 {ms(s['e2e_p50_s'])}   p99 {ms(s['e2e_p99_s'])}",
        f"throughput {s['output_tok_s']:.1f} output tok/s, {s['req_s']:.2f} req/s",
        f"goodput    {s['goodput_req_s']:.2f} req/s meet both SLOs "
        f"({100 * s['max_gap_slo_request_share']:.0f}% of requests sent)",
    ]
    lines += [f"error      {n} x {msg}" for msg, n in s["error_messages"].items()]
    return "\n".join(lines)


def add_mix_arguments(p: Any, defaults: MixSpec) -> None:
    """The workload flags, shared by the locustfile, this runner and the sweep."""
    p.add_argument("--prompt-median", type=int, default=defaults.prompt_median,
                   help="short prompts: median tokens (lognormal)")
    p.add_argument("--output-median", type=int, default=defaults.output_median,
                   help="outputs: median tokens (lognormal; exact, sent with ignore_eos)")
    p.add_argument("--long-share", type=float, default=defaults.long_share,
                   help="share of requests with a long prompt")
    p.add_argument("--long-min", type=int, default=defaults.long_min, help="long prompts: min tokens")
    p.add_argument("--long-max", type=int, default=defaults.long_max, help="long prompts: max tokens")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size,
                   help="prompt token ids are drawn below it (the embedded models have >= 2048)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    p.add_argument("--prompts", choices=PROMPT_SOURCES, default=defaults.prompts,
                   help="random token ids, or real chat prompts in --model's chat template "
                        "(tests/support/real_text.py: questions, and passage tasks for the long share)")


def add_slo_arguments(p: Any, ttft_ms: float = TTFT_SLO_MS, tbt_ms: float = TBT_SLO_MS) -> None:
    p.add_argument("--ttft-slo-ms", type=float, default=ttft_ms, help="TTFT SLO (goodput)")
    p.add_argument("--tbt-slo-ms", type=float, default=tbt_ms, help="TBT SLO: no gap above it (goodput)")


def mix_from_args(args: argparse.Namespace, rps: float) -> MixSpec:
    return MixSpec(rps=rps, prompt_median=args.prompt_median, output_median=args.output_median,
                   long_share=args.long_share, long_min=args.long_min, long_max=args.long_max,
                   vocab_size=args.vocab_size, seed=args.seed, prompts=args.prompts)


def main(argv: list[str] | None = None) -> int:
    # --seed comes with the workload flags (the locustfile takes them too); the results go to --out.
    p = bench_parser("loadtests.load.loadtest", __doc__, model="", model_help="model name to send (default: the server's)",
                     seed=OMIT, json_path=OMIT)
    p.add_argument("--host", default="http://127.0.0.1:8000")
    p.add_argument("--duration", type=parse_duration, default=60.0, help="arrival window (60s, 2m)")
    p.add_argument("--drain", type=parse_duration, default=30.0,
                   help="at most this long after the window for open requests to finish")
    p.add_argument("--rps", type=float, default=2.0, help="offered requests/s (Poisson)")
    p.add_argument("--out", type=Path, default=Path("loadtests/out"))
    add_slo_arguments(p)
    add_mix_arguments(p, MixSpec())
    args = p.parse_args(argv)
    if args.prompts == "real" and not args.model:
        p.error("--prompts real needs --model: its tokenizer templates the prompts")
    mix = mix_from_args(args, args.rps)
    samples = run_locust(args.host, args.out, duration_s=args.duration, drain_s=args.drain, mix=mix,
                         ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms, model=args.model)
    _, reqs = load_samples(samples)
    summary = summarize(reqs, args.ttft_slo_ms / 1e3, args.tbt_slo_ms / 1e3)
    summary["config"] = {"host": args.host, "duration_s": args.duration, "drain_s": args.drain,
                         **{k: v for k, v in mix.to_dict().items() if k != "avoid_ids"}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nSummary ({args.rps:g} req/s offered for {args.duration:g} s against {args.host}):")
    print(format_summary(summary))
    print(f"\nwrote {args.out}/{PREFIX}_stats.csv (Locust CSVs), {args.out}/{PREFIX}.html, "
          f"{samples}, {args.out}/summary.json")
    return 0 if summary["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
