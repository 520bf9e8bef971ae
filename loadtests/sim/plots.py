"""Figures: capacity per policy and SLO (docs/results/capacity.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"static": "#9e9e9e", "dynamic": "#f28e2b", "stall_free": "#4e79a7"}


def capacity_figure(results: list[dict[str, Any]], path: Path) -> None:
    """One panel per workload: capacity (req/s per replica) by SLO, one bar per policy."""
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = res["rows"]
        slos = list(dict.fromkeys(r["slo"] for r in rows))
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        width = 0.8 / len(policies)
        for j, policy in enumerate(policies):
            xs, ys = [], []
            for i, slo in enumerate(slos):
                row = next(r for r in rows if r["slo"] == slo and r["policy"] == policy)
                xs.append(i + (j - (len(policies) - 1) / 2) * width)
                ys.append(row["capacity_rps"])
                ax.text(xs[-1], ys[-1], f"{ys[-1]:.2f}", ha="center", va="bottom", fontsize=8)
            ax.bar(xs, ys, width, label=policy, color=COLORS.get(policy))
        labels = []
        for slo in slos:
            row = next(r for r in rows if r["slo"] == slo)
            ratio = res["stall_free_over_dynamic"].get(slo)
            extra = f"\nstall_free/dynamic {ratio:.1f}x" if ratio else ""
            labels.append(f"{slo}: P99 TBT <= {row['tbt_slo_s'] * 1e3:.0f} ms{extra}")
        ax.set_xticks(range(len(slos)), labels, fontsize=9)
        ax.set_ylabel("capacity (req/s per replica)")
        ax.set_title(f"{res['model']} on {res['gpu']}, {res['workload']}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Capacity: highest rate with P99 TBT within the SLO and median scheduling delay <= 2 s "
                 "(simulated)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
