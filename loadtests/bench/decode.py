"""Decode passes against the model's bare forward, and where a pass's time goes.

    python -m loadtests.bench.decode [--model embedded:mid] [--threads 2] [--json PATH]
    python -m loadtests.bench.decode --profile [--json PATH]    # the per-pass breakdown

Check 1 (equal contexts): B running decodes with the same short context (B = 8, 32, 64). The
engine's pass (`Engine.step()`: schedule, metadata, forward with paged attention, sampling,
postprocess) against the model's bare forward over the same B tokens (HF, sdpa, no KV cache,
`use_cache=False`): the engine's price for paging, batching and bookkeeping. Beside it, HF's own
decode step over the same B contexts (a StaticCache holding each sequence's
context contiguously, cropped back after every step): the same work, attention over the context
included, with no paging, scheduling or sampling. The bare forward reads no KV at all; at
B = 64 x 128 tokens of fp32 context that KV is about as many bytes as the model's weights, so
pass / HF decode separates the engine's own price from the cost of attending over the context.

Check 2 (mixed contexts): a few long-context decodes beside many short ones, against the same
number of decodes whose contexts are all equal with the same total. Attention that pads every
decode to the longest context pays for the longest x B; attention that follows the real tokens
pays for the total either way, so the ratio stays near 1.

`--profile` runs the same cases under torch.profiler with each phase of the pass labelled
(schedule, metadata, GEMMs, rotary, attention: cache write, gather, SDPA; sampling,
postprocess, detokenization, metrics) and prints ms per pass by phase (profiler fractions
scaled to the unprofiled median pass time).

Medians over the timed passes; this machine is shared and noisy: read ratios within one run.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, StaticCache
from transformers.models.llama import modeling_llama

from loadtests.harness.report import OMIT, bench_parser, report
from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution import model_runner
from replicas.detokenizer import IncrementalDetokenizer

EQUAL_BATCHES = (8, 32, 64)
SHORT_CONTEXT = 128


def fill(engine: Engine, contexts: list[int], seed: int = 0) -> None:
    """Queue one request per context length and run until every one of them is decoding."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for n in contexts:
        engine.add_request(torch.randint(10, engine.vocab_size, (n,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up decodes
        engine.step()


def make_engine(model: str, contexts: list[int], threads: int, compiled: bool = False) -> Engine:
    total = sum(contexts) + 1100 * len(contexts)
    config = EngineConfig(max_num_seqs=len(contexts), max_batch_prefill_tokens=2048,
                          max_batch_total_tokens=-(-total // 16) * 16, num_threads=threads,
                          compile_decode_attention=compiled)
    return Engine.from_pretrained(model, config)


class PassTimer:
    """Times `Engine.step()` and the model call inside it (attention included), pass by pass."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.passes, self.forward = engine, [], []
        self._model = engine.runner.model

    def _timed_model(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._model(*args, **kwargs)
        finally:
            self.forward.append(time.perf_counter() - t)

    def step(self) -> None:
        runner = self.engine.runner
        runner.model = self._timed_model
        try:
            t = time.perf_counter()
            self.engine.step()
            self.passes.append(time.perf_counter() - t)
        finally:
            runner.model = self._model

    def medians(self) -> dict[str, float]:
        return {"pass_ms": 1e3 * statistics.median(self.passes),
                "forward_ms": 1e3 * statistics.median(self.forward)}


def time_passes(engine: Engine, steps: int) -> dict[str, float]:
    timer = PassTimer(engine)
    for _ in range(steps):
        timer.step()
    return timer.medians()


@torch.inference_mode()
def bare_forward(engine: Engine, tokens: int) -> Any:
    """The model's own forward over `tokens` tokens: HF sdpa attention, no cache, all logits."""
    ids = torch.randint(10, engine.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    return lambda: engine.model(input_ids=ids, use_cache=False)  # no attn_meta: plain sdpa


def cache_kwarg(model: Any) -> str:
    """The name an HF causal LM's forward takes its KV cache by: transformers renamed
    `past_key_values` to `cache` (the old name deprecated, then gone)."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def hf_decode_step(engine: Engine, batch: int, context: int) -> Any:
    """HF's own decode step: B sequences of `context` cached tokens in a StaticCache (contiguous,
    written in place, no padding: equal lengths), one new token each; the cache is cropped back
    after each step, so every step attends over the same context."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, engine.vocab_size, (batch, context), generator=g)
    cache = StaticCache(config=engine.model.config, max_cache_len=context + 1)
    step_ids = torch.randint(10, engine.vocab_size, (batch, 1), generator=g)
    positions = torch.full((batch, 1), context)
    name = cache_kwarg(engine.model)
    with torch.inference_mode():
        engine.model(input_ids=ids, use_cache=True, **{name: cache})

    def step() -> Any:
        with torch.inference_mode():
            out = engine.model(input_ids=step_ids, position_ids=positions, use_cache=True, **{name: cache})
        cache.crop(-1)
        return out
    return step


def _timed(fn: Any, into: list[float]) -> None:
    t = time.perf_counter()
    fn()
    into.append(time.perf_counter() - t)


def equal_case(model: str, batch: int, steps: int, threads: int, compiled: bool) -> dict[str, float]:
    """Engine passes, bare forwards and HF decode steps alternate, so all see the same machine."""
    engine = make_engine(model, [SHORT_CONTEXT] * batch, threads, compiled)
    fill(engine, [SHORT_CONTEXT] * batch)
    timer, bare, hf = PassTimer(engine), bare_forward(engine, batch), hf_decode_step(engine, batch, SHORT_CONTEXT)
    bare_times: list[float] = []
    hf_times: list[float] = []
    bare()
    hf()
    for _ in range(steps):
        timer.step()
        _timed(bare, bare_times)
        _timed(hf, hf_times)
    row = timer.medians() | {"bare_ms": 1e3 * statistics.median(bare_times),
                             "hf_decode_ms": 1e3 * statistics.median(hf_times)}
    row["pass_over_bare"] = row["pass_ms"] / row["bare_ms"]
    row["forward_over_bare"] = row["forward_ms"] / row["bare_ms"]
    row["pass_over_hf_decode"] = row["pass_ms"] / row["hf_decode_ms"]
    return {"batch": batch, "context": SHORT_CONTEXT} | row


def mixed_case(model: str, batch: int, num_long: int, long_ctx: int, short_ctx: int, steps: int,
               threads: int, compiled: bool) -> dict[str, Any]:
    """Two engines (mixed contexts, equal contexts of the same total) stepped alternately."""
    mixed = [long_ctx] * num_long + [short_ctx] * (batch - num_long)
    equal = [sum(mixed) // batch] * batch
    timers = {}
    for name, contexts in (("mixed", mixed), ("equal", equal)):
        engine = make_engine(model, contexts, threads, compiled)
        fill(engine, contexts)
        timers[name] = PassTimer(engine)
    for _ in range(steps):
        for timer in timers.values():
            timer.step()
    rows = {name: timer.medians() for name, timer in timers.items()}
    return {"batch": batch, "num_long": num_long, "long_context": long_ctx, "short_context": short_ctx,
            "equal_context": equal[0], "total_context": sum(mixed),
            "mixed_pass_ms": rows["mixed"]["pass_ms"], "equal_pass_ms": rows["equal"]["pass_ms"],
            "mixed_forward_ms": rows["mixed"]["forward_ms"], "equal_forward_ms": rows["equal"]["forward_ms"],
            "pass_ratio": rows["mixed"]["pass_ms"] / rows["equal"]["pass_ms"],
            "forward_ratio": rows["mixed"]["forward_ms"] / rows["equal"]["forward_ms"]}


# ---- the per-pass profile -----------------------------------------------------------------

# Labelled scopes -> the phase they stand for; ops counted by name inside the forward.
PHASES = ("schedule", "metadata", "forward", "sample", "postprocess", "detokenize", "metrics")
FORWARD_PARTS = ("linear (GEMMs)", "rotary", "attention", "other (norms, act, embed, views)")
ATTENTION_PARTS = {"aten::index_copy_": "kv write", "aten::index_select": "kv gather",
                   "aten::scaled_dot_product_attention": "sdpa"}


def _scoped(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def labelled(engine: Engine) -> Iterator[None]:
    """Label the pass's phases for the profiler (patched for the duration only)."""
    runner, sched = engine.runner, engine.scheduler
    saved = [(runner, "prepare", runner.prepare), (runner, "model", runner.model),
             (sched, "schedule", sched.schedule), (engine, "_postprocess", engine._postprocess),
             (runner.sampler, "sample_on_device", runner.sampler.sample_on_device),
             (IncrementalDetokenizer, "add_token", IncrementalDetokenizer.add_token),
             (modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)]
    runner.prepare = _scoped("prepare", runner.prepare)
    runner.model = _scoped("forward", runner.model)
    sched.schedule = _scoped("schedule", sched.schedule)
    engine._postprocess = _scoped("postprocess", engine._postprocess)
    runner.sampler.sample_on_device = _scoped("sample", runner.sampler.sample_on_device)
    IncrementalDetokenizer.add_token = _scoped("detokenize", IncrementalDetokenizer.add_token)
    modeling_llama.apply_rotary_pos_emb = _scoped("rotary", modeling_llama.apply_rotary_pos_emb)
    AttentionInterface.register(model_runner.ATTN_IMPL, _scoped("attention", model_runner.paged_attention))
    observers = list(engine.observers)
    engine.observers[:] = [_ScopedObserver(o) for o in observers]
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        AttentionInterface.register(model_runner.ATTN_IMPL, model_runner.paged_attention)
        engine.observers[:] = observers


class _ScopedObserver:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def on_iteration(self, *args: Any) -> None:
        with torch.profiler.record_function("metrics"):
            self.inner.on_iteration(*args)

    def on_abort(self, *args: Any) -> None:
        self.inner.on_abort(*args)


def profile_case(engine: Engine, steps: int) -> dict[str, float]:
    """ms per pass by phase: profiler fractions scaled to the unprofiled median pass."""
    wall = time_passes(engine, steps)["pass_ms"]
    with labelled(engine), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = 1e3 * (time.perf_counter() - t) / steps
    total = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages()}  # ms per pass, inclusive
    scale = wall / profiled

    def ms(key: str) -> float:
        return scale * total.get(key, 0.0)

    row = {"pass_ms": wall, "profiled_pass_ms": profiled}
    for phase in PHASES:
        row[phase] = ms(phase)
    row["metadata"] = ms("prepare")  # the pass's host side: metadata, sampling plan, upload
    row["postprocess"] -= row["detokenize"]  # reported on its own
    row["linear (GEMMs)"] = ms("aten::linear")
    row["rotary"] = ms("rotary")
    row["attention"] = ms("attention")
    for op, part in ATTENTION_PARTS.items():
        row[part] = ms(op)
    row["other (norms, act, embed, views)"] = row["forward"] - sum(row[p] for p in FORWARD_PARTS[:3])
    row["loop rest"] = wall - sum(row[p] for p in PHASES)
    return row


def format_profile(rows: dict[str, dict[str, float]]) -> str:
    names = list(rows)
    lines = [f"{'ms per pass':<34}" + "".join(f"{n:>16}" for n in names)]
    order = ["pass_ms", *PHASES[:2], "forward", *(f"  {p}" for p in FORWARD_PARTS),
             *(f"    {p}" for p in ATTENTION_PARTS.values()), *PHASES[3:], "loop rest"]
    for key in order:
        lines.append(f"{key:<34}" + "".join(f"{rows[n][key.strip()]:>16.2f}" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("loadtests.bench.decode", __doc__, seed=OMIT, threads=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--long-context", type=int, default=2048)
    p.add_argument("--num-long", type=int, default=2)
    p.add_argument("--short-context", type=int, default=96)
    p.add_argument("--profile", action="store_true", help="the per-pass breakdown instead of the checks")
    p.add_argument("--compile-decode-attention", action="store_true",
                   help="the engine's compiled in-place decode kernel (EngineConfig.compile_decode_attention)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    compiled = args.compile_decode_attention
    attention = "compiled in-place decode attention" if compiled else "eager attention"
    result: dict[str, Any] = {"model": args.model, "threads": args.threads, "steps": args.steps,
                              "compile_decode_attention": args.compile_decode_attention}
    if args.profile:
        cases = {"B=8": [SHORT_CONTEXT] * 8, "B=64": [SHORT_CONTEXT] * 64,
                 f"B=64 {args.num_long}x{args.long_context}":
                     [args.long_context] * args.num_long + [args.short_context] * (64 - args.num_long)}
        rows = {}
        for name, contexts in cases.items():
            engine = make_engine(args.model, contexts, args.threads, compiled)
            fill(engine, contexts)
            rows[name] = profile_case(engine, args.steps)
        text = (f"Per-pass profile: {args.model}, {attention}, {args.threads} torch thread(s), decodes at context "
                f"{SHORT_CONTEXT} (mixed: {args.num_long} at {args.long_context}, the rest at "
                f"{args.short_context}), medians of {args.steps} passes\n" + format_profile(rows))
        result["profile"] = rows
    else:
        equal = [equal_case(args.model, b, args.steps, args.threads, compiled) for b in EQUAL_BATCHES]
        mixed = [mixed_case(args.model, b, args.num_long, args.long_context, args.short_context,
                            args.steps, args.threads, compiled) for b in (32, 64)]
        lines = [f"Decode passes: {args.model}, {attention}, {args.threads} torch thread(s), "
                 f"medians of {args.steps} passes",
                 f"equal contexts ({SHORT_CONTEXT} tokens): engine pass vs the model's bare forward over B tokens",
                 f"{'B':>4}{'pass ms':>10}{'forward ms':>12}{'bare ms':>10}{'pass/bare':>11}{'fwd/bare':>10}"
                 f"{'HF decode ms':>14}{'pass/HF decode':>16}"]
        for r in equal:
            lines.append(f"{r['batch']:>4}{r['pass_ms']:>10.2f}{r['forward_ms']:>12.2f}{r['bare_ms']:>10.2f}"
                         f"{r['pass_over_bare']:>11.2f}{r['forward_over_bare']:>10.2f}"
                         f"{r['hf_decode_ms']:>14.2f}{r['pass_over_hf_decode']:>16.2f}")
        lines += [f"mixed contexts ({args.num_long} at {args.long_context}, the rest at {args.short_context}) "
                  "vs equal contexts with the same total",
                  f"{'B':>4}{'total ctx':>10}{'mixed ms':>10}{'equal ms':>10}{'ratio':>8}"
                  f"{'mixed fwd':>11}{'equal fwd':>11}{'fwd ratio':>11}"]
        for r in mixed:
            lines.append(f"{r['batch']:>4}{r['total_context']:>10}{r['mixed_pass_ms']:>10.2f}"
                         f"{r['equal_pass_ms']:>10.2f}{r['pass_ratio']:>8.2f}{r['mixed_forward_ms']:>11.2f}"
                         f"{r['equal_forward_ms']:>11.2f}{r['forward_ratio']:>11.2f}")
        lines.append("targets: pass/bare <= 1.2 at every B; mixed/equal <= 1.3")
        text = "\n".join(lines)
        result |= {"equal": equal, "mixed": mixed}
    return report(text, result, args.json)


if __name__ == "__main__":
    main()
