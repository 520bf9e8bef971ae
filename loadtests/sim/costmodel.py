"""Iteration time of one forward pass, predicted from the batch (the simulator's stand-in for the GPU).

One model, two sources of coefficients:

    T = overhead + per_seq * S + comm_per_token * N + combine(compute, memory)
    compute = per_prefill_token * P + per_decode_token * D + per_attn_pair * A
    memory  = weights + per_kv_token * C + per_padded_kv_token * X

P prefill tokens, D decode tokens, N = P + D, S sequences, C KV tokens attended (sum over the
batch's sequences of start + num_tokens, exactly what the engine's IterationStats records), A
query-key pairs of attention (a chunk of n tokens at position s attends n*s + n(n+1)/2 keys),
X = D * the longest decode context (KV a runner touches when it pads every decode to the longest
one, as this repo's CPU model runner does; paged GPU kernels do not, so X is 0 on GPU profiles).
`combine` is `max` for a roofline (a pass is bound by the slower of tensor-core work and HBM
traffic) or `sum` (a plain linear model).

- `CostModel.from_profile(gpu, model)` derives the coefficients from datasheet figures
  (profiles.json): GEMM FLOPs 2 * params per token and attention 4 * layers * heads * head_dim per
  pair at peak FLOP/s * efficiency; weights read once per pass and KV bytes read per attended
  token at HBM bandwidth * efficiency, both split over tensor-parallel ranks; two ring
  all-reduces per layer over the link for TP > 1.
- `fit(x, y, form)` fits the same coefficients to timings the real engine recorded (the
  engine's own non-negative least squares, `replicas.scheduling.pass_time.fit_nonnegative`; features the
  engine did not record are all-zero columns and keep coefficient 0).
  `form="max"` is a segmented fit: each iteration is assigned to the branch that binds, the
  branches are refitted, repeat.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from loadtests.harness.stats import percentile
from replicas.scheduling.pass_time import chunk_pairs, fit_nonnegative

PROFILES_PATH = Path(__file__).with_name("profiles.json")
Form = Literal["max", "sum"]


def load_profiles(path: Path | str = PROFILES_PATH) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass as a function of the batch's token counts."""

    overhead_s: float = 0.0
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_token_s: float = 0.0
    per_attn_pair_s: float = 0.0
    weights_s: float = 0.0
    per_kv_token_s: float = 0.0
    comm_per_token_s: float = 0.0
    per_padded_kv_token_s: float = 0.0
    form: Form = "max"
    name: str = ""

    def __post_init__(self) -> None:
        if self.form not in ("max", "sum"):
            raise ValueError(f"form must be 'max' or 'sum', got {self.form!r}")

    def compute_s(self, prefill: float, decode: float, pairs: float = 0.0) -> float:
        return self.per_prefill_token_s * prefill + self.per_decode_token_s * decode + self.per_attn_pair_s * pairs

    def memory_s(self, context: float, padded: float = 0.0) -> float:
        return self.weights_s + self.per_kv_token_s * context + self.per_padded_kv_token_s * padded

    def iteration_time(self, prefill: int, decode: int, context: int, num_seqs: int, pairs: int = 0,
                       padded: int = 0) -> float:
        """Predicted duration of one pass (seconds)."""
        c, m = self.compute_s(prefill, decode, pairs), self.memory_s(context, padded)
        body = (c if c > m else m) if self.form == "max" else c + m
        return self.overhead_s + self.per_seq_s * num_seqs + self.comm_per_token_s * (prefill + decode) + body

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Vectorised over rows of feature columns (P, D, C, S, A, X); see `FEATURES`."""
        p, d, c, s, a, xp = (x[:, i] for i in range(6))
        comp = self.per_prefill_token_s * p + self.per_decode_token_s * d + self.per_attn_pair_s * a
        mem = self.weights_s + self.per_kv_token_s * c + self.per_padded_kv_token_s * xp
        body = np.maximum(comp, mem) if self.form == "max" else comp + mem
        return self.overhead_s + self.per_seq_s * s + self.comm_per_token_s * (p + d) + body

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_profile(cls, gpu: str, model: str, tp: int | None = None,
                     profiles: dict[str, Any] | None = None) -> CostModel:
        """Roofline coefficients for `model` on `gpu` (names in profiles.json)."""
        prof = profiles or load_profiles()
        g, m, e = prof["gpus"][gpu], prof["models"][model], prof["efficiency"]
        tp = tp or m["tp"]
        flops = g["peak_flops"] * e["compute"] * tp  # the pass's work is split over tp ranks
        hbm = g["hbm_bytes_per_s"] * e["memory"]  # each rank streams its share in parallel
        per_token = 2.0 * m["params"] / flops
        per_pair = 4.0 * m["layers"] * m["heads"] * m["head_dim"] / flops
        weights = m["params"] * e["dtype_bytes"] / tp / hbm
        per_kv = kv_bytes_per_token(m, e["dtype_bytes"], tp) / hbm
        comm, overhead = 0.0, e["overhead_s"]
        if tp > 1:
            # Two ring all-reduces of the hidden state per layer: 2 (tp-1)/tp of the bytes cross a link.
            ring = 2.0 * (tp - 1) / tp
            comm = 2 * m["layers"] * ring * m["hidden"] * e["dtype_bytes"] / (g["link_bytes_per_s"] * e["link"])
            overhead += 2 * m["layers"] * e["allreduce_latency_s"]
        return cls(overhead_s=overhead, per_prefill_token_s=per_token, per_decode_token_s=per_token,
                   per_attn_pair_s=per_pair, weights_s=weights, per_kv_token_s=per_kv, comm_per_token_s=comm,
                   form="max", name=f"{model}@{gpu}x{tp}")


def kv_bytes_per_token(model: dict[str, Any], dtype_bytes: int, tp: int = 1) -> float:
    """K and V bytes one token occupies on one rank (KV heads are split, or replicated when tp > kv_heads)."""
    heads_per_rank = math.ceil(model["kv_heads"] / tp)
    return 2.0 * model["layers"] * heads_per_rank * model["head_dim"] * dtype_bytes


def kv_capacity_tokens(gpu: str, model: str, tp: int | None = None, profiles: dict[str, Any] | None = None) -> int:
    """KV tokens one replica holds: (memory * utilisation - weights - activations) / KV bytes per token."""
    prof = profiles or load_profiles()
    g, m, e = prof["gpus"][gpu], prof["models"][model], prof["efficiency"]
    tp = tp or m["tp"]
    free = (g["memory_bytes"] * e["gpu_memory_utilization"] - m["params"] * e["dtype_bytes"] / tp
            - e["activation_reserve_bytes"])
    if free <= 0:
        raise ValueError(f"{model} does not fit on {gpu} with tp={tp}")
    return int(free // kv_bytes_per_token(m, e["dtype_bytes"], tp))


# ---- features and fitting -----------------------------------------------------------------

FEATURES = ("prefill", "decode", "context", "num_seqs", "pairs", "padded")


def batch_features(batch: Any) -> tuple[int, int, int, int, int, int]:
    """(P, D, C, S, A, X) of a `SchedulerOutput` (decodes first, as the pass packs them)."""
    starts = [s.start for s in batch.decodes]
    d = len(starts)
    ctx_d = sum(starts) + d
    p = ctx_p = pairs_p = 0
    for s in batch.prefills:
        n, st = s.num_tokens, s.start
        p += n
        ctx_p += st + n
        pairs_p += chunk_pairs(st, n)
    padded = d * (max(starts) + 1) if d else 0
    return p, d, ctx_d + ctx_p, d + len(batch.prefills), ctx_d + pairs_p, padded


def features(stats: Iterable[Any]) -> np.ndarray:
    """(n, 6) feature rows from IterationStats-like records; `pairs`/`padded` are 0 unless present."""
    rows = [(s.num_prefill_tokens, s.num_decode_tokens, s.context_tokens, s.num_seqs,
             getattr(s, "pairs", 0), getattr(s, "padded", 0)) for s in stats]
    return np.asarray(rows, dtype=float).reshape(-1, 6)


def fit(x: np.ndarray, y: np.ndarray, form: Form = "sum", max_iter: int = 50) -> CostModel:
    """Non-negative least-squares coefficients of `CostModel` from feature rows `x` (see `features`)
    and durations `y`.

    sum: y ~ overhead + pP + dD + kC + sS + aA + xX, one linear solve (the constant is `overhead_s`).
    max: y ~ overhead + sS + max(pP + dD + aA, w + kC + xX); segmented least squares, started
    from several splits of the iterations into compute- and memory-bound, best fit kept.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    p, d, c, s, a, xp = (x[:, i] for i in range(6))
    one = np.ones_like(y)
    if form == "sum":
        o, kp, kd, kc, ks, ka, kx = fit_nonnegative(np.column_stack([one, p, d, c, s, a, xp]), y)
        return CostModel(overhead_s=o, per_seq_s=ks, per_prefill_token_s=kp, per_decode_token_s=kd,
                         per_attn_pair_s=ka, per_kv_token_s=kc, per_padded_kv_token_s=kx, form="sum",
                         name="fit:sum")
    best: tuple[float, CostModel] | None = None
    share = p / np.maximum(p + d, 1)
    starts = [share > q for q in (0.0, 0.25, 0.5, 0.75)] + [p + d > np.median(p + d)]
    for bound in starts:
        model = None
        for _ in range(max_iter):
            if bound.all() or not bound.any():
                break
            cb, mb = bound.astype(float), (~bound).astype(float)
            cols = np.column_stack([one, s, p * cb, d * cb, a * cb, mb, c * mb, xp * mb])
            o, ks, kp, kd, ka, w, kc, kx = fit_nonnegative(cols, y)
            model = CostModel(overhead_s=o, per_seq_s=ks, per_prefill_token_s=kp, per_decode_token_s=kd,
                              per_attn_pair_s=ka, weights_s=w, per_kv_token_s=kc, per_padded_kv_token_s=kx,
                              form="max", name="fit:max")
            new = model.compute_s(p, d, a) >= model.memory_s(c, xp)
            if (new == bound).all():
                break
            bound = new
        if model is None:
            continue
        sse = float(((model.predict(x) - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, model)
    if best is None:  # one regime only: the linear model is the roofline's single branch
        return dataclasses.replace(fit(x, y, "sum"), name="fit:max(degenerate)")
    return best[1]


def fit_error(model: CostModel, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Relative error of per-iteration predictions: p50, p90 (nearest-rank), mean, and R^2."""
    pred = model.predict(np.asarray(x, float))
    y = np.asarray(y, float)
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    ss_res, ss_tot = float(((pred - y) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {"rel_err_p50": percentile(rel.tolist(), 50), "rel_err_p90": percentile(rel.tolist(), 90),
            "rel_err_mean": float(rel.mean()), "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            "total_time_err": float(pred.sum() / y.sum() - 1.0), "n": int(len(y))}
