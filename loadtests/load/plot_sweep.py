"""Draw `docs/results/latency_vs_load.png` from the sweep's rows (or from docs/results/sweep.json).

    python -m loadtests.load.plot_sweep docs/results/sweep.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"static": ("tab:gray", "s"), "dynamic": ("tab:red", "o"), "stall_free": ("tab:blue", "^"),
         "stall_free+slo": ("tab:green", "v")}


def plot(rows: list[dict[str, Any]], config: dict[str, Any], path: Path) -> Path:
    """Four panels against offered req/s: p99 TBT and p99 TTFT (SLOs dashed, log scale),
    output tokens/s, and goodput (requests/s meeting both SLOs)."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = [("tbt_p99_s", "p99 TBT (ms)", config["tbt_slo_ms"], 1e3),
              ("ttft_p99_s", "p99 TTFT (s)", config["ttft_slo_ms"] / 1e3, 1.0),
              ("output_tok_s", "throughput (output tokens/s)", None, 1.0),
              ("goodput_req_s", "goodput (requests/s meeting both SLOs)", None, 1.0)]
    for ax, (key, label, slo, scale) in zip(axes.flat, panels):
        for policy in config["policies"]:
            pts = sorted((r["rps"], r[key] * scale) for r in rows
                         if r["policy"] == policy and r.get(key) is not None)
            if not pts:
                continue
            color, marker = STYLE.get(policy, (None, "x"))
            ax.plot(*zip(*pts), marker=marker, color=color, label=policy)
        if slo is not None:
            ax.axhline(slo, color="black", linestyle="--", linewidth=1, label=f"SLO {slo:g}")
        if slo is not None:
            ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mix, real = config["mix"], config.get("real_prompt_lens")
    prompts = (f"chat prompts {real['short'][0]}-{real['short'][1]} tokens with {mix['long_share']:.0%} "
               f"passage tasks ({real['long'][0]}-{real['long'][1]})" if real else
               f"prompts ~{mix['prompt_median']} tokens with {mix['long_share']:.0%} long "
               f"({mix['long_min']}-{mix['long_max']})")
    fig.suptitle(
        f"{config['model']} on {config.get('machine', 'CPU')}, {config['torch_threads']} torch thread(s): "
        f"stall_free MBP {config['chunk_mbp']}, dynamic/static MBP {config['whole_prompt_mbp']}, "
        f"KV {config['kv_tokens']} tokens for all\n{prompts}, outputs "
        f"~{mix['output_median']} tokens; open-loop Poisson, {config['duration_s']:g} s per point",
        fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    src = Path((argv or sys.argv[1:] or ["docs/results/sweep.json"])[0])
    data = json.loads(src.read_text())
    print(plot(data["rows"], data["config"], src.with_name("latency_vs_load.png")))


if __name__ == "__main__":
    main()
