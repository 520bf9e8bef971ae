"""The start-mode table after the queue-admission change (serve_config.yaml's TBT SLO, SLO
admission, 10 s queue deadline, refusal on a predicted miss), from this folder's JSON (7aefa0d;
runs repeated later are ov_<start>_<outputs>_at_<commit>.json, listed after):
python docs/results/overload_start_modes_admission/table.py"""
import json
from pathlib import Path

HERE = Path(__file__).parent


def ms(v):
    return "-" if v is None else f"{v * 1000:.0f}"


print("| start | outputs | sustainable / offered req/s | 429s | 429 p50 / p99 ms | door probe 429 p99 ms "
      "| refused by the replica after queueing: n, p99 ms | accepted TTFT p50 / p99 ms | accepted TBT p99 ms (sustainable's) | 5xx / cut "
      "| generator loop lag p99 / behind max ms | back to normal after | door, niceness (/health) |")
print("|---|---|---|---:|---|---:|---|---|---|---|---|---|---|")


def rows():
    """The table's runs (7aefa0d), then each run again at a later commit (ov_<mode>_<n>_at_<commit>)."""
    for mode in ("make", "serve-run", "cluster"):
        for tokens in (96, 256):
            yield mode, tokens, HERE / f"ov_{mode}_{tokens}.json"
    for path in sorted(HERE.glob("ov_*_at_*.json")):
        mode, tokens, commit = path.stem[3:].replace("_at_", "_").rsplit("_", 2)
        yield f"{mode} at {commit}", int(tokens), path


for mode, tokens, path in rows():
    if not path.exists():
        continue
    d = json.loads(path.read_text())
    o, s = d["overload"], d["overload"]["summary"]
    c, health = s["counts"], d["server"]["health"]
    rec = o["recovery"]["recovery_s"]
    late = [v for k, v in s["reject_by"].items()
            if k in ("replica: queue deadline", "replica: predicted past deadline")]
    late_n = sum(v["n"] for v in late)
    late_p99 = max((v["p99_s"] for v in late), default=None)
    print(f"| {mode} | {tokens} | {d['search']['sustainable_req_s']:g} / {s['offered_req_s']:.1f} | {c['429']} "
          f"| {ms(s['reject_p50_s'])} / {ms(s['reject_p99_s'])} | {ms(o['door_probe']['reject_p99_s'])} "
          f"| {late_n}, {ms(late_p99)} | {ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])} | {ms(s['tbt_p99_s'])} ({ms(d['search']['baseline_tbt_p99_s'])}) "
          f"| {c['5xx']} / {c['cut']} | {ms(o['client_loop_lag']['p99_s'])} / {ms(o['client_max_lag_s'])} "
          f"| {'not within ' + str(d['config']['recovery_s']) + ' s' if rec is None else f'{rec:.1f} s'} "
          f"| {'on' if health.get('proxy_door') else 'missing'}, {health.get('niceness')} |")
