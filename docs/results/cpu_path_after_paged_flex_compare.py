"""Before (50faf31) / after (HEAD) of the CPU path: bench_engine --quick and bench_decode, two
alternated rounds each side on this 2-core VM; medians of the rounds, after/before ratios."""
import json, statistics, sys
R = (1, 2)
def load(kind, side): return [json.load(open(f"/tmp/ab/{kind}_{side}_{r}.json")) for r in R]
out = {"machine": "shared 2-core x86_64 CPU VM, no GPU; torch 2.13.0+cpu; runs alternated before/after, nothing else ran",
       "before": "50faf31", "after": sys.argv[1],
       "commands": ["python -m loadtests.bench.engine --quick --json PATH", "python -m loadtests.bench.decode --json PATH"],
       "engine": {}, "decode": {}}
b, a = load("engine", "before"), load("engine", "after")
for i, row in enumerate(b[0]["rows"]):
    if not row["system"].startswith("engine"):
        continue
    key = f"{row['workload']}/{row['system']}"
    med = lambda runs, f: statistics.median(r["rows"][i][f] for r in runs)
    out["engine"][key] = {f: {"before": round(med(b, f), 4), "after": round(med(a, f), 4),
                              "after_over_before": round(med(a, f) / med(b, f), 3)}
                          for f in ("output_tok_s", "tbt_p50_s", "tbt_p99_s")}
b, a = load("decode", "before"), load("decode", "after")
for i, row in enumerate(b[0]["equal"]):
    med = lambda runs: statistics.median(r["equal"][i]["pass_ms"] for r in runs)
    out["decode"][f"B={row['batch']} pass_ms"] = {"before": round(med(b), 2), "after": round(med(a), 2),
                                                  "after_over_before": round(med(a) / med(b), 3)}
for i, row in enumerate(b[0]["mixed"]):
    med = lambda runs: statistics.median(r["mixed"][i]["mixed_pass_ms"] for r in runs)
    out["decode"][f"mixed B={row['batch']} pass_ms"] = {"before": round(med(b), 2), "after": round(med(a), 2),
                                                        "after_over_before": round(med(a) / med(b), 3)}
print(f"{'case':<36}{'field':<14}{'before':>10}{'after':>10}{'ratio':>8}")
for k, v in out["engine"].items():
    for f, x in v.items():
        print(f"{k:<36}{f:<14}{x['before']:>10}{x['after']:>10}{x['after_over_before']:>8}")
for k, x in out["decode"].items():
    print(f"{k:<36}{'':<14}{x['before']:>10}{x['after']:>10}{x['after_over_before']:>8}")
json.dump(out, open("/work/main/docs/results/cpu_path_after_paged_flex.json", "w"), indent=1)
