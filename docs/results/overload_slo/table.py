"""The table of docs/results/overload.md's "The TBT SLO against 10x overload" from this folder's JSON:
python docs/results/overload_slo/table.py"""
import json
from pathlib import Path

HERE = Path(__file__).parent
ROWS = [("a_none_fcfs", "none", "FCFS (before)"), ("a_slo250_fcfs", "250", "FCFS (before)"),
        ("a_slo250_admission_fcfs", "250 + slo_admission", "FCFS (before)"),
        ("b_none", "none", "short ones first"), ("b_slo250", "250", "short ones first"),
        ("b_slo500", "500", "short ones first"), ("b_slo1000", "1000", "short ones first"),
        ("b_slo500_queue5", "500, queue_timeout_s 5", "short ones first")]


def ms(v):
    return "-" if v is None else f"{v * 1000:.0f}"


print("| tbt_slo_ms | prompts in progress | sustainable req/s | offered req/s | accepted | 429 p50 / p99 ms "
      "| accepted TTFT p50 / p99 ms | accepted TBT p99 ms (sustainable's) | ratio | 5xx / cut |")
print("|---|---|---:|---:|---:|---|---|---|---:|---|")
for name, slo, sched in ROWS:
    d = json.loads((HERE / f"{name}.json").read_text())
    o, s = d["overload"], d["overload"]["summary"]
    base = d["search"]["baseline_tbt_p99_s"]
    c = s["counts"]
    print(f"| {slo} | {sched} | {d['search']['sustainable_req_s']:g} | {s['offered_req_s']:.1f} | {s['accepted']} "
          f"| {ms(s['reject_p50_s'])} / {ms(s['reject_p99_s'])} | {ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])} "
          f"| {ms(s['tbt_p99_s'])} ({ms(base)}) | {s['tbt_p99_s'] / base:.2f} | {c['5xx']} / {c['cut']} |")
