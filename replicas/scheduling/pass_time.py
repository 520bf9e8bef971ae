"""How long a forward pass takes, predicted from what is in it, and the SLO budget rule.

The model is linear in what the scheduler knows before a pass runs:

    seconds = c0 + c_p * prefill_tokens + c_d * decode_tokens + c_s * sequences
               + c_c * context_tokens + c_a * attention_pairs

(context_tokens: KV tokens attended, summed over the pass's sequences, as `IterationStats`
records it: what attention reads; attention_pairs: query-key pairs, what attention computes. A
decode's pairs are its context; a prefill chunk of p tokens after s cached ones has p*s + p(p+1)/2,
so a chunk deep into a long prompt costs more than one at its start, which the context alone
misses: without it the CPU engine's hybrid passes near a 1 s target ran up to 1.56x their
prediction, p90 1.22x; with it 1.21x, p90 1.01x). It is fitted by least squares, with
non-negative coefficients, to a sliding window of the engine's own recent passes plus a few seed
passes profiled at start (which keep every coefficient identifiable when the window holds, say,
only decodes). So it follows the machine it runs on and the model it serves, without offline
calibration.

`slo_prefill_budget` is the decision: the largest prefill chunk whose predicted pass time stays
under the target, given the decodes already in the pass. `kv_pass_target` lowers that target when
the KV cache would not hold the requests that passes of the target's length keep alive (Little's
law). Pure functions and a small stateful fitter, no torch: the scheduler calls them and the
simulator can import them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

FEATURES = ("intercept", "prefill_tokens", "decode_tokens", "sequences", "context_tokens",
            "attention_pairs")
# The fit is trusted while the median relative error of its recent predictions stays under this.
MAX_PREDICTION_ERROR = 0.25
ERROR_WINDOW = 32  # predictions the trust check looks back over
MIN_FIT_PASSES = 4  # observations before the model predicts at all
_PREFILL = FEATURES.index("prefill_tokens")  # in a window row's features
# How much slower than predicted recent passes ran (`PassTimeModel.underestimate`), from actual /
# predicted over the last RATIO_WINDOW passes predicted at least a quarter of the error floor
# (the target), once there are MIN_RATIOS of them: the larger of their RATIO_QUANTILE and the tail
# their spread implies one pass in a thousand reaches (TAIL_Z standard deviations of a log-normal
# whose median and 90th percentile are theirs). A tail because an SLO on gaps is judged there: one
# pass over the SLO is a gap over it for every stream in the pass. The window's own quantile
# cannot see past its 128 passes; on this project's 2-core CPU, passes near the target ran at a
# median 1.0x their prediction, p90 ~1.15x, and in 1-2% of them 1.25-1.35x, each of those a gap
# over the SLO (docs/results/sweep.md); the spread's tail there is ~1.4x. On a quiet accelerator the
# spread is a few percent and the margin alone applies.
RATIO_QUANTILE = 0.99
TAIL_Z = 3.09  # the standard normal's 99.9th percentile
_Z90 = 1.2816  # ... and its 90th
RATIO_WINDOW = 128
MIN_RATIOS = 16


_START = attrgetter("start")  # a scheduled sequence's first position

@dataclass(frozen=True)
class PassShape:
    """What one pass holds, as far as its time is concerned."""

    prefill_tokens: int
    decode_tokens: int
    sequences: int
    context_tokens: int
    attention_pairs: int

    @classmethod
    def of(cls, batch: Any) -> PassShape:
        """The shape of a `SchedulerOutput` (context: each sequence's start + its tokens). A
        decode's pairs are its context, so only the prefill chunks (a few a pass) add to that."""
        decodes, prefills = batch.decodes, batch.prefills
        chunks = sum(s.start + s.num_tokens for s in prefills)
        context = sum(map(_START, decodes)) + len(decodes) + chunks  # a decode's one token
        pairs = context - chunks + sum(chunk_pairs(s.start, s.num_tokens) for s in prefills)
        return cls(batch.num_prefill_tokens, len(decodes), len(decodes) + len(prefills), context, pairs)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.decode_tokens), float(self.sequences),
                float(self.context_tokens), float(self.attention_pairs))


def chunk_pairs(start: int, tokens: int) -> int:
    """Query-key pairs of `tokens` causal queries after `start` cached tokens (a decode: start+1)."""
    return tokens * start + tokens * (tokens + 1) // 2


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; numpy only)."""
    n = a.shape[1]
    x, active = np.zeros(n), np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if active.all() or np.where(active, -np.inf, w).max() <= 1e-12 * max(1.0, float(np.abs(w).max())):
            break
        active[int(np.argmax(np.where(active, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if (z[active] > 0).all():
                x = z
                break
            neg = active & (z <= 0)
            x = x + np.min(x[neg] / (x[neg] - z[neg])) * (z - x)
            active &= x > 1e-15
        w = a.T @ (b - a @ x)
    return x


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: each is a time per unit of work (collinear
    counts such as decode tokens and sequences would otherwise trade signs and extrapolate
    badly). Columns are scaled so token counts in the thousands and the intercept weigh alike;
    all-zero columns (features absent from the data) get coefficient 0. The simulator's cost
    model fits with this too (loadtests/sim/costmodel.py)."""
    scale = np.abs(x).max(axis=0)
    live = scale > 0
    coef = np.zeros(x.shape[1])
    coef[live] = nnls(x[:, live] / scale[live], y) / scale[live]
    return coef


class PassTimeModel:
    """Seconds per pass from its shape, refitted online over a window of recent passes."""

    def __init__(self, window: int = 256, refit_every: int = 8, error_floor_s: float = 0.0) -> None:
        """`error_floor_s`: errors count relative to max(actual, error_floor_s), so a few ms
        missed on a pass far below the target (the SLO) do not make the model untrusted."""
        self.error_floor_s = error_floor_s
        self.window: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.seed: list[tuple[tuple[float, ...], float]] = []
        self.seeded = False  # the start-up profile is in (`freeze_seed`); SLO admission waits for it
        self.refit_every = refit_every
        self.coef: np.ndarray | None = None
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.ratios: deque[float] = deque(maxlen=RATIO_WINDOW)  # actual / predicted
        self._underestimate: float | None = None  # the quantile of `ratios`, while it is fresh
        self._ratios_changed = False
        self._since_fit = 0
        self._window_s = 0.0  # the seconds in `window`, summed
        self._prefill_s, self._prefill_n = 0.0, 0  # the same over its passes that carried prefill

    @property
    def mean_pass_s(self) -> float | None:
        """Mean time of the passes in the window (None while it is empty)."""
        return self._window_s / len(self.window) if self.window else None

    @property
    def prefill_share(self) -> float:
        """Share of the window's passes that carried prompt tokens (0 while it is empty)."""
        return self._prefill_n / len(self.window) if self.window else 0.0

    @property
    def mean_prefill_pass_s(self) -> float | None:
        """Mean time of the window's passes that carried prompt tokens, the ones a prefill budget
        sizes (None while there are none)."""
        return self._prefill_s / self._prefill_n if self._prefill_n else None

    def freeze_seed(self) -> None:
        """The passes observed so far (the start-up profile) are kept for good, beside the
        window, so every coefficient stays identifiable."""
        self.seeded = True
        self.seed.extend(self.window)
        self.window.clear()
        self._window_s = 0.0
        self._prefill_s, self._prefill_n = 0.0, 0
        self.errors.clear()
        self.ratios.clear()
        self._ratios_changed = True
        self._refit()

    def observe(self, shape: PassShape, seconds: float, predicted: float | None = None) -> None:
        """A pass ran; `predicted` is what the model said before it ran (tracks the error)."""
        if predicted is not None and seconds > 0:
            self.errors.append(abs(predicted - seconds) / max(seconds, self.error_floor_s))
            if predicted > 0 and predicted >= self.error_floor_s / 4:
                self.ratios.append(seconds / predicted)
                self._ratios_changed = True
        if len(self.window) == self.window.maxlen:
            old, old_s = self.window[0]
            self._window_s -= old_s
            if old[_PREFILL] > 0:
                self._prefill_s, self._prefill_n = self._prefill_s - old_s, self._prefill_n - 1
        self.window.append((shape.features(), seconds))
        self._window_s += seconds
        if shape.prefill_tokens > 0:
            self._prefill_s, self._prefill_n = self._prefill_s + seconds, self._prefill_n + 1
        self._since_fit += 1
        if self.coef is None or self._since_fit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        rows = self.seed + list(self.window)
        if len(rows) < MIN_FIT_PASSES:
            return
        x = np.array([r[0] for r in rows])
        y = np.array([r[1] for r in rows])
        self._window_s = sum(seconds for _, seconds in self.window)  # the running sums, re-anchored
        prefill = [seconds for f, seconds in self.window if f[_PREFILL] > 0]
        self._prefill_s, self._prefill_n = sum(prefill), len(prefill)
        self.coef = fit_nonnegative(x, y)
        self._since_fit = 0

    def predict(self, shape: PassShape) -> float | None:
        if self.coef is None:
            return None
        return float(np.dot(self.coef, shape.features()))

    @property
    def recent_error(self) -> float | None:
        """Median relative error of the last predictions (None before there are any); relative
        to max(actual, error_floor_s)."""
        return float(np.median(self.errors)) if self.errors else None

    @property
    def underestimate(self) -> float | None:
        """How many times its prediction a pass takes at the tail, over the recent passes that
        were predicted at least a quarter of the error floor (short ones' noise says little about
        a pass near the target): the larger of the RATIO_QUANTILE of actual / predicted (what the
        window saw) and median x exp(TAIL_Z x spread), spread = ln(p90 / median) / z90 (what a
        log-normal with the window's body reaches once in a thousand passes); None until there
        are MIN_RATIOS. On a machine whose passes are slowed by neighbours (the server's other
        processes, other tenants) this is well above 1 even while the fit's median error is small."""
        if self._ratios_changed:  # computed once per new ratio, not per decision
            self._ratios_changed = False
            self._underestimate = None if len(self.ratios) < MIN_RATIOS else tail_ratio(
                np.fromiter(self.ratios, float))
        return self._underestimate

    @property
    def trusted(self) -> bool:
        err = self.recent_error
        return self.coef is not None and (err is None or err <= MAX_PREDICTION_ERROR)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Marginal prefill rate: what one more prompt token costs (its compute and its KV)."""
        if self.coef is None:
            return None
        per_token = self.coef[1] + self.coef[4]
        return 1.0 / per_token if per_token > 0 else None

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, (0.0,) * len(FEATURES) if self.coef is None else map(float, self.coef)))


def tail_ratio(ratios: np.ndarray) -> float:
    """The overrun a pass reaches at the tail, from recent actual / predicted ratios (see
    `PassTimeModel.underestimate`)."""
    seen = float(np.quantile(ratios, RATIO_QUANTILE, method="higher"))
    median, p90 = np.quantile(ratios, (0.5, 0.9))
    if median <= 0:
        return seen
    spread = max(0.0, float(np.log(p90 / median))) / _Z90
    return max(seen, float(median * np.exp(TAIL_Z * spread)))


def calibrated_target(target_s: float, slo_s: float | None, underestimate: float | None) -> float:
    """The pass-time target: `target_s` (the SLO x budget_margin), lowered to slo_s / underestimate
    when recent passes overran their prediction by more than the margin leaves room for (a
    pass predicted at that target then ends within the SLO at the ratio's tail). Never raised:
    the margin is the least headroom. Without an SLO or a measured ratio: `target_s`."""
    if slo_s is None or underestimate is None or underestimate <= 0:
        return target_s
    return min(target_s, slo_s / underestimate)


def slo_prefill_budget(cost: Callable[[int], float], target_s: float, ceiling: int, floor: int) -> int:
    """The largest prefill chunk p in [floor, ceiling] with cost(p) <= target_s (cost rising in p).

    `ceiling` is what the fixed budget would allow (MBP minus the decodes); `floor` keeps prompts
    moving when even the decodes alone are predicted over the target.
    """
    floor = max(0, min(floor, ceiling))
    if cost(ceiling) <= target_s:
        return ceiling
    lo, hi = floor, ceiling  # cost(hi) > target; find the largest p with cost(p) <= target
    if cost(lo) > target_s:
        return floor
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= target_s:
            lo = mid
        else:
            hi = mid
    return lo


# The KV cap acts only once the cache is more than this full: below it, projecting the occupancy
# from a small one (the ratio goal / used) over-reacts. On the CPU engine (sweep workload, KV never
# short: 0 preemptions) a cap from any occupancy cut the chunk by ~15% for nothing; in the
# simulator both forms give the same capacities.
KV_CAP_FROM = 0.5


def kv_pass_target(target_s: float, mean_pass_s: float | None, kv_used: int, kv_goal: int,
                   prefill_mean_s: float | None = None, prefill_share: float = 1.0) -> float:
    """The pass-time target, lowered so that the KV the running requests hold fits in `kv_goal`.

    Little's law: at a given request rate, the requests alive (and so the KV they hold) grow in
    proportion to how long they live, which is their number of passes times the pass time. The
    `kv_used` tokens held now were built up under passes of `mean_pass_s` on average, so passes of
    mean_pass_s * kv_goal / kv_used on average would hold about `kv_goal`. Only the passes that
    carry prompt tokens (a share `prefill_share` of them, `prefill_mean_s` long on average) are
    sized by a prefill budget; for the mean of all to reach that, theirs must become

        prefill_mean_s + mean_pass_s * (kv_goal / kv_used - 1) / prefill_share

    (every pass carrying prompt tokens, share 1: mean_pass_s * kv_goal / kv_used). Once the cache
    is over `KV_CAP_FROM` of the goal the target is capped there. It pulls the passes back to the
    length whose KV fits (shorter passes: decodes finish sooner and free their blocks, where longer
    ones would fill the cache and leave prompts waiting for blocks, or preempt). Under that
    occupancy, with nothing held, or with no pass seen yet: `target_s` itself.
    """
    goal = max(kv_goal, 0)
    if kv_used <= 0 or kv_used <= KV_CAP_FROM * goal or mean_pass_s is None:
        return target_s
    if prefill_mean_s is None or prefill_share <= 0:
        return min(target_s, mean_pass_s * goal / kv_used)
    return min(target_s, max(0.0, prefill_mean_s + mean_pass_s * (goal / kv_used - 1) / prefill_share))


class SloBudget:
    """The stall_free scheduler's `prefill_budget` hook under a TBT SLO (the engine's and the
    simulator's): every decode first, then the largest prefill chunk whose predicted pass time
    stays under `target_s`; the fixed ceiling while the model is not trusted.

    With `slo_s` (the SLO itself) the target is first lowered to what the model's recent
    under-estimates leave room for (`calibrated_target`).
    With `kv` (the scheduler's `BlockManager`) the target is also capped by `kv_pass_target`:
    the goal is the KV the scheduler may fill (its capacity less the `kv_reserve_blocks` admission
    keeps free) less what the request whose chunk comes next still needs, so that it can go on.
    Only the passes carrying prompt tokens are sized by this budget, so the cap asks them alone to
    bring the mean of all passes where Little's law wants it (capping them at the mean of all
    passes times goal / used would, once decode-only passes are most of them, hold hybrid passes
    near twice a decode pass, far under the SLO).

    After each `schedule()`, `last` is the budget it chose (None: the ceiling applied),
    `last_target_s` the target it aimed at, and `fallback` whether the ceiling applied because the
    model was untrusted; `reset()` before scheduling.
    """

    def __init__(self, model: PassTimeModel, target_s: float, floor: int, log: Any = None,
                 kv: Any = None, kv_reserve_blocks: int = 0, slo_s: float | None = None) -> None:
        self.model, self.target_s, self.floor, self.slo_s = model, target_s, floor, slo_s
        self.log = log
        self.kv, self.kv_reserve_blocks = kv, kv_reserve_blocks
        self.last_target_s: float | None = None
        self.last: int | None = None
        self.fallback = False
        self.untrusted = False  # the model's state at the last decision (logged when it flips)

    def reset(self) -> None:
        self.last, self.fallback, self.last_target_s = None, False, None

    def target_for(self, nxt: Any) -> float:
        """This pass's target: the SLO's (calibrated by the model's recent under-estimates), capped
        by the KV (`kv_pass_target`) when it is known."""
        target = calibrated_target(self.target_s, self.slo_s, self.model.underestimate)
        kv = self.kv
        if kv is None:
            return target
        bs = kv.block_size
        used = (kv.num_blocks - kv.num_free) * bs
        goal = (kv.num_blocks - self.kv_reserve_blocks) * bs - max(0, nxt.num_tokens - nxt.num_computed_tokens)
        model = self.model
        return kv_pass_target(target, model.mean_pass_s, used, goal, model.mean_prefill_pass_s,
                              model.prefill_share)

    def __call__(self, decodes: Sequence[Any], nxt: Any, ceiling: int) -> int:
        """`decodes`: the pass's ScheduledSeqs so far; `nxt`: the request whose chunk comes next."""
        model = self.model
        if not model.trusted:
            if not self.untrusted and self.log is not None:
                self.log.warning("pass-time model not trusted (median error %s): the fixed prefill "
                                 "budget applies", model.recent_error)
            self.untrusted = self.fallback = True
            return ceiling
        if self.untrusted and self.log is not None:
            self.log.info("pass-time model trusted again (median error %.2f): SLO budget",
                          model.recent_error or 0.0)
        self.untrusted = False
        d = len(decodes)
        decode_context = sum(s.start for s in decodes) + d  # a decode's pairs are its context
        start = nxt.num_computed_tokens

        def cost(p: int) -> float:
            return model.predict(PassShape(p, d, d + 1, decode_context + start + p,
                                           decode_context + chunk_pairs(start, p)))

        self.last_target_s = target = self.target_for(nxt)
        self.last = slo_prefill_budget(cost, target, ceiling, self.floor)
        return self.last


def seed_shapes(ceiling: int) -> Iterable[tuple[int, int]]:
    """(prompt length, requests) of the start-up profile: prefills of a few sizes up to the
    ceiling, then their decodes (a handful of passes in all)."""
    sizes = sorted({max(1, ceiling // d) for d in (1, 2, 4, 8)})
    return [(n, 1) for n in sizes] + [(max(1, ceiling // 16), 8)]


def slo_hooks(config: Any, model: PassTimeModel, kv: Any, kv_reserve_blocks: int,
              log: Any = None) -> tuple[SloBudget, SloAdmission | None]:
    """The stall_free scheduler's SLO budget and (with `config.slo_admission`) SLO admission, as
    the engine and the simulator build them from an `EngineConfig` with `tbt_slo_ms`: the target
    tbt_slo_ms x budget_margin, calibrated against the SLO itself, the KV cap over `kv` (the
    scheduler's BlockManager) less the blocks admission keeps free."""
    slo_s, target = config.tbt_slo_s, config.slo_pass_target_s
    budget = SloBudget(model, target, config.slo_budget_floor, log, kv=kv,
                       kv_reserve_blocks=kv_reserve_blocks, slo_s=slo_s)
    admission = SloAdmission(model, target, config.slo_budget_floor, slo_s) if config.slo_admission else None
    return budget, admission


def slo_control(config: Any, kv: Any, kv_reserve_blocks: int, log: Any = None
                ) -> tuple[PassTimeModel | None, SloBudget | None, SloAdmission | None]:
    """What an engine with `config` schedules by: with `tbt_slo_ms`, a pass-time model and, under
    stall_free with `slo_budget`, the SLO budget and (opt-in) SLO admission on it; else nothing."""
    if config.tbt_slo_ms is None:
        return None, None, None
    model = PassTimeModel(error_floor_s=config.slo_pass_target_s)
    if config.policy != "stall_free" or not config.slo_budget:
        return model, None, None
    return (model, *slo_hooks(config, model, kv, kv_reserve_blocks, log))


class SloAdmission:
    """The stall_free scheduler's `may_admit` hook under a TBT SLO: a waiting request starts only
    while a pass that decodes every running request and it, beside the least prefill chunk the
    budget allows (`floor`), is predicted within `target_s`.

    The SLO budget protects the gap of the streams running by shrinking the prefill chunk; this
    protects it from the number of streams itself: past the point where their decodes alone fill
    the target, admitting more would stretch every stream's gap, so the request waits (and past
    the queue deadline is refused) instead. Running requests are never preempted for it. With an
    untrusted model, or nothing running, it admits (the fixed rules apply). With `slo_s` the
    target is calibrated as the budget's is (`calibrated_target`).
    `held` counts the passes in which it held the next request back (the queue is strict FCFS).
    """

    def __init__(self, model: PassTimeModel, target_s: float, floor: int, slo_s: float | None = None) -> None:
        self.model, self.target_s, self.floor, self.slo_s = model, target_s, floor, slo_s
        self.held = 0

    def __call__(self, num_running: int, running_tokens: int, request: Any) -> bool:
        """`num_running` requests hold `running_tokens` tokens; `request` would join them."""
        if not num_running or not self.model.trusted or not self.model.seeded:
            return True
        n = num_running + 1
        context = running_tokens + request.num_tokens  # what the n decodes attend
        shape = PassShape(self.floor, n, n + 1, context + self.floor, context + chunk_pairs(0, self.floor))
        predicted = self.model.predict(shape)
        if predicted is None or predicted <= calibrated_target(self.target_s, self.slo_s, self.model.underestimate):
            return True
        self.held += 1
        return False
