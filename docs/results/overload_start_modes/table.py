import json
print("| start | outputs | offered req/s | 429s | 429 p50 / p99 ms | door probe 429 p99 ms | accepted TTFT p99 ms | accepted TBT p99 ms (sustainable's) | 5xx | cut | generator loop lag p99 / behind max ms | door, niceness (/health) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for mode in ("make", "serve-run", "cluster"):
    try: health = json.load(open(f"docs/results/overload_start_modes/health_{mode}.json"))
    except Exception: health = {}
    for t in (96, 256):
        try: d = json.load(open(f"docs/results/overload_start_modes/ov_{mode}_{t}.json")); d["overload"]
        except Exception: continue
        o = d["overload"]; s = o["summary"]; c = s["counts"]
        ms = lambda v: f"{v*1000:.0f}" if v is not None else "-"
        print(f"| {mode} | {t} | {s['offered_req_s']:.1f} | {c.get('429', s['status_codes'].get('429'))} | {ms(s['reject_p50_s'])} / {ms(s['reject_p99_s'])} | "
              f"{ms(o['door_probe']['reject_p99_s'])} | {ms(s['ttft_p99_s'])} | {ms(s['tbt_p99_s'])} ({ms(d['search']['baseline_tbt_p99_s'])}) | "
              f"{c.get('5xx', 0)} | {c.get('cut', 0)} | {ms(o['client_loop_lag']['p99_s'])} / {ms(o['client_max_lag_s'])} | "
              f"{'on' if health.get('proxy_door') else 'missing'}, {health.get('niceness')} |")
