"""Engine benchmark: HF baselines and the three scheduling policies, side by side in one run.

    python -m loadtests.bench.engine [--quick] [--json PATH] [--model embedded:mid]
    python -m loadtests.bench.engine --model embedded:smollm2 --quick --poisson-rate 2.5  # ~15 min
    python -m loadtests.bench.engine --model embedded:smollm2 --poisson-rate 1.75        # ~1 hour

On a real model (embedded:smollm2, SmolLM2-135M-Instruct) chat and chat_poisson send real chat
prompts (`--prompts real`, the default on any model but the random-weight embedded:tiny/mid):
the questions and passage tasks of loadtests/real_text.py in the model's own chat template
(~40 tokens; a quarter quote a passage, ~300), the same token ids to every system, HF baselines
included. Output lengths stay the fixed-seed draws, run with ignore_eos, so every system makes
the same number of tokens. long_prompt and long_context keep random ids: prompt length is what
they test, and 2k tokens fit the model's 8192 positions. The prefix cache is off for every
system unless `--prefix-caching` (real prompts repeat a system prompt and a few passages, which
HF's static batches cannot share). SmolLM2's 30 layers make it ~4x slower per token than
embedded:mid, so the default Poisson rates (set for embedded:mid, below) would be a t=0 burst
on it: the rates above make its arrivals span about half of what stall_free takes.

Four fixed-seed workloads (see loadtests/workloads.py; `--workloads` picks a subset):
- chat: mixed heavy-tailed prompt/output lengths, all requests at t=0 (offline throughput);
- chat_poisson: the very same requests, arriving as a Poisson process at `--poisson-rate`;
- long_prompt: short requests decoding while long prompts arrive (wall-clock arrivals);
- long_context: 2 long-context requests (prompt 1500-1900, 128 out) decoding beside 32 short
  ones (prompt and output 64-128), all at t=0: decode attention must cost the real contexts,
  not the longest one padded over every row. Quick: prompts 1000-1200, 96 out, 16 shorts.

The default Poisson rate makes the arrivals span about half of what stall_free takes on chat,
so every system is loaded past its capacity (a queue builds) without a t=0 burst: quick chat is
32 requests, 1767 output tokens (mean 55, the longest 128), ~5.6 s for stall_free at ~316 tok/s,
so 12 req/s (arrivals over ~3.1 s; the engine's capacity is ~316 / 55 = 5.7 req/s). The full
chat (96 requests, 7840 tokens, mean 82) takes ~30 s at an expected ~250 tok/s: 6 req/s
(arrivals over ~19 s). At a rate near the engine's capacity (6-8 req/s quick) the arrivals
would span the whole run and the engine's output tok/s would measure the arrival rate.

Systems: HF `generate` on static left-padded batches of 16 (arrival order); transformers'
own continuous batching (the manager behind `generate_batch`, fed per-request lengths);
and this engine under `static`, `dynamic` and `stall_free`. The HF baselines run on every
workload but long_prompt (`--long-baselines` adds them there). Every system gets the same KV
capacity: what 16 padded sequences of the workload's longest request hold (on long_context
16 x ~2000 tokens, over three times what all its requests hold at once: no system is KV-bound).

Metrics per system: output tokens/s = output tokens / (last token - first arrival);
TTFT = first token - arrival; TBT = gaps between a request's consecutive tokens, pooled.
This machine is shared and noisy: compare ratios measured in one run, not absolute figures.
With other processes on the cores, 2-thread torch ops wait on a descheduled sibling thread
(every op of a step pays a scheduler slice); `--threads 1 --repeats 3` is far steadier there.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from tqdm import tqdm

from loadtests.harness.report import bench_parser, report
from loadtests.harness.stats import percentile
from loadtests.harness.workloads import (PROMPT_SOURCES, ChatPromptPool, LengthDist, Workload, WorkloadRequest,
                                 chat_workload, default_prompt_source, long_context_workload,
                                 long_prompt_workload, with_chat_prompts, with_poisson_arrivals)
from replicas import Engine, EngineConfig, SamplingParams
from replicas.loading.models import load_model

HF_BATCH = 16  # static padded batch size of the HF `generate` baseline
WORKLOADS = ("chat", "chat_poisson", "long_prompt", "long_context")
POISSON_RATE = {"quick": 12.0, "full": 6.0}  # req/s on chat_poisson: see the module docstring


@dataclass
class Trace:
    """When one request arrived and when each of its output tokens appeared (perf_counter)."""

    request_id: str
    kind: str
    arrival: float
    token_times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SystemSpec:
    name: str  # table label
    kind: str  # "hf_static" | "hf_cb" | "engine"
    policy: str | None = None
    mbp: int | None = None  # engine: max_batch_prefill_tokens; hf_cb: max_batch_tokens
    overlap: str = "auto"  # engine: EngineConfig.overlap


# ---- metrics ----------------------------------------------------------------------------


def summarize(traces: list[Trace]) -> dict:
    """Throughput and latency percentiles (nearest-rank) over all requests of one run."""
    first = min(t.arrival for t in traces)
    last = max(t.token_times[-1] for t in traces if t.token_times)
    out = sum(len(t.token_times) for t in traces)
    ttft = [t.token_times[0] - t.arrival for t in traces if t.token_times]
    tbt = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]

    def pct(values: list[float], q: float) -> float:
        p = percentile(values, q)
        return float("nan") if p is None else p

    row = {"output_tokens": out, "elapsed_s": last - first, "output_tok_s": out / (last - first),
           "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
           "tbt_p50_s": pct(tbt, 50), "tbt_p99_s": pct(tbt, 99), "tbt_max_s": pct(tbt, 100)}
    for kind in sorted({t.kind for t in traces}):
        sub = [t.token_times[0] - t.arrival for t in traces if t.kind == kind and t.token_times]
        row[f"ttft_p50_{kind}_s"] = pct(sub, 50)
    return row


# ---- systems ----------------------------------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(engine: Engine, workload: Workload, desc: str) -> list[Trace]:
    """Drive `engine.step()`, adding each request when its arrival offset has passed."""
    pending = deque(sorted(workload.requests, key=lambda r: r.arrival_s))
    added: list[tuple[WorkloadRequest, object]] = []
    bar = tqdm(total=sum(workload.output_lens), desc=desc, unit="tok", leave=False)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_s <= now:
            w = pending.popleft()
            req = engine.add_request(w.prompt_token_ids, _greedy(w.max_tokens),
                                     request_id=w.request_id, arrival_time=t0 + w.arrival_s)
            added.append((w, req))
        if engine.has_unfinished():
            bar.update(sum(len(d.delta_token_ids) for d in engine.step()))
        else:
            time.sleep(max(0.0, min(0.005, t0 + pending[0].arrival_s - now)))
    bar.close()
    return [Trace(w.request_id, w.kind, r.arrival_time, list(r.token_times)) for w, r in added]


class _StepClock(transformers.LogitsProcessor):
    """Stamps each decoding step: called once per step, just before the step's tokens are picked."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model, pad_id: int, workload: Workload, desc: str) -> list[Trace]:
    """HF `generate` on left-padded batches of HF_BATCH in arrival order; each batch runs to
    its longest member's length (min_new_tokens forces it past EOS)."""
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)
    traces: list[Trace] = []
    bar = tqdm(total=sum(workload.output_lens), desc=desc, unit="tok", leave=False)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), HF_BATCH):
        batch = reqs[i:i + HF_BATCH]
        time.sleep(max(0.0, t0 + batch[-1].arrival_s - time.perf_counter()))  # batch is complete
        width = max(r.prompt_len for r in batch)
        ids = torch.tensor([[pad_id] * (width - r.prompt_len) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
        n = max(r.max_tokens for r in batch)
        clock = _StepClock()
        config = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                               pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=transformers.LogitsProcessorList([clock]))
        assert out.shape[1] == width + n and len(clock.times) == n, "HF generate stopped early"
        for r in batch:  # a request's tokens are those up to its own max_tokens
            traces.append(Trace(r.request_id, r.kind, t0 + r.arrival_s, clock.times[:r.max_tokens]))
        bar.update(sum(r.max_tokens for r in batch))
    bar.close()
    return traces


def run_hf_cb(model, pad_id: int, workload: Workload, kv_tokens: int, max_batch_tokens: int,
              max_seqs: int, desc: str, block_sharing: bool = False) -> tuple[list[Trace], dict]:
    """transformers' continuous batching manager (what `generate_batch` wraps), fed each
    request at its arrival with its own max_new_tokens; EOS disabled (eos_token_id=-1).
    `block_sharing`: its prefix cache, as the engine's `enable_prefix_caching`."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256  # transformers' default page size
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=max(1, kv_tokens // page), max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs, allow_block_sharing=block_sharing)
    gen_config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens),
                                               eos_token_id=-1, pad_token_id=pad_id)
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    attn = model.config._attn_implementation  # what the manager runs with (it may restore on stop)
    manager.start()
    try:
        _cb_collect(manager, [WorkloadRequest("warmup", [5, 6, 7, 8], 3)], time.perf_counter())
        pending = sorted(workload.requests, key=lambda r: r.arrival_s)
        bar = tqdm(total=len(pending), desc=desc, unit="req", leave=False)
        t0 = time.perf_counter()
        results = _cb_collect(manager, pending, t0, bar)
        bar.close()
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    info = {"attn_implementation": attn, "page_size": page,
            "num_blocks": cb_config.num_blocks, "max_batch_tokens": max_batch_tokens,
            "max_requests_per_batch": max_seqs, "allow_block_sharing": block_sharing}
    traces = []
    for r in workload.requests:
        res = results[r.request_id]
        if res.error is not None or len(res.generated_tokens) != r.max_tokens:
            raise RuntimeError(f"{r.request_id}: error={res.error!r}, "
                               f"{len(res.generated_tokens)}/{r.max_tokens} tokens")
        traces.append(Trace(r.request_id, r.kind, t0 + r.arrival_s, list(res.timestamps)))
    return traces, info


def _cb_collect(manager, reqs: list[WorkloadRequest], t0: float, bar: tqdm | None = None) -> dict:
    """Submit each request once its arrival offset has passed; wait for all results."""
    pending, results = deque(reqs), {}
    while len(results) < len(reqs):
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_s <= now:
            r = pending.popleft()
            manager.add_request(r.prompt_token_ids, request_id=r.request_id,
                                max_new_tokens=r.max_tokens, record_timestamps=True, eos_token_id=-1)
        wait = max(0.001, t0 + pending[0].arrival_s - now) if pending else 1.0
        res = manager.get_result(timeout=wait)
        if res is not None and res.is_finished():
            results[res.request_id] = res
            if bar is not None:
                bar.update(1)
        elif res is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching loop stopped")
    return results


# ---- the plan ---------------------------------------------------------------------------


def build_workloads(vocab_size: int, avoid_ids: list[int], quick: bool, seed: int, *,
                    chat_requests: int | None = None, long_shorts: int | None = None,
                    poisson_rate: float | None = None, context_longs: int = 2,
                    context_shorts: int | None = None,
                    pool: ChatPromptPool | None = None) -> list[Workload]:
    """The four workloads, in WORKLOADS order; `quick` shrinks each to a short run. With a
    `pool`, chat (and so chat_poisson) sends its real chat prompts; long_prompt and long_context
    keep random ids, whose lengths are what they test."""
    if quick:
        chat = chat_workload(
            chat_requests or 32, vocab_size, seed, avoid_ids=avoid_ids,
            prompt=LengthDist("lognormal", 96, 8, 384, sigma=0.9),
            output=LengthDist("lognormal", 32, 4, 128, sigma=0.9))
        long = long_prompt_workload(
            vocab_size, seed, num_short=long_shorts or 12, avoid_ids=avoid_ids, num_long=2,
            short_output=LengthDist("lognormal", 64, 48, 96, sigma=0.15),
            long_prompt=LengthDist("uniform", 1100, 1000, 1200), first_long_s=0.3,
            long_interval_s=0.8)
        context = long_context_workload(
            vocab_size, seed, num_long=context_longs, num_short=context_shorts or 16,
            long_prompt=LengthDist("uniform", 1100, 1000, 1200), long_output=96,
            short_output=LengthDist("uniform", 72, 48, 96), avoid_ids=avoid_ids)
    else:
        chat = chat_workload(chat_requests or 96, vocab_size, seed, avoid_ids=avoid_ids)
        long = long_prompt_workload(vocab_size, seed, num_short=long_shorts or 16, avoid_ids=avoid_ids)
        context = long_context_workload(vocab_size, seed, num_long=context_longs,
                                        num_short=context_shorts or 32, avoid_ids=avoid_ids)
    if pool is not None:
        chat = with_chat_prompts(chat, pool)
    rate = poisson_rate or POISSON_RATE["quick" if quick else "full"]
    return [chat, with_poisson_arrivals(chat, rate, name="chat_poisson"), long, context]


def kv_capacity(workload: Workload, block_size: int) -> int:
    """KV tokens HF_BATCH padded sequences of the workload's longest request hold (block-aligned)."""
    return HF_BATCH * workload.max_total_len // block_size * block_size


def whole_prompt_mbp(workload: Workload, multiple: int = 256) -> int:
    """The smallest MBP (rounded up) that lets `dynamic` prefill the longest prompt in one pass."""
    return -(-max(workload.prompt_lens) // multiple) * multiple


def systems_for(workload: Workload, chunk_mbp: int, baselines: bool, overlap: bool = False) -> list[SystemSpec]:
    """`overlap`: stall_free's overlapped loop too (EngineConfig.overlap on), beside the auto one."""
    whole = whole_prompt_mbp(workload)
    specs = [SystemSpec("hf_generate_static16", "hf_static"),
             SystemSpec("hf_generate_batch", "hf_cb", mbp=chunk_mbp)] if baselines else []
    overlapped = [SystemSpec("engine_stall_free_overlap", "engine", "stall_free", chunk_mbp, "on")] if overlap else []
    return specs + [SystemSpec("engine_static", "engine", "static", whole),
                    SystemSpec("engine_dynamic", "engine", "dynamic", whole),
                    SystemSpec("engine_stall_free", "engine", "stall_free", chunk_mbp)] + overlapped


class Runner:
    """Loads the model once per system family and runs one system on one workload."""

    def __init__(self, model_name: str, block_size: int, max_num_seqs: int,
                 compile_decode_attention: bool = False, prefix_caching: bool = False) -> None:
        self.model_name, self.block_size, self.max_num_seqs = model_name, block_size, max_num_seqs
        self.compile_decode_attention, self.prefix_caching = compile_decode_attention, prefix_caching
        self._models: dict[str, tuple] = {}

    def model(self, family: str):
        if family not in self._models:  # each family sets its own attention implementation
            self._models[family] = load_model(self.model_name)
            if family == "hf_static":  # warm-up: one tiny padded batch
                lm, tok = self._models[family]
                lm.generate(input_ids=torch.tensor([[5, 6, 7, 8]] * 2), max_new_tokens=3,
                            min_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
        return self._models[family]

    def run(self, spec: SystemSpec, workload: Workload) -> tuple[list[Trace], dict]:
        kv = kv_capacity(workload, self.block_size)
        desc = f"{workload.name}/{spec.name}"
        if spec.kind == "hf_static":
            lm, tok = self.model("hf_static")
            return run_hf_static(lm, tok.pad_token_id, workload, desc), {"batch_size": HF_BATCH}
        if spec.kind == "hf_cb":
            lm, tok = self.model("hf_cb")
            return run_hf_cb(lm, tok.pad_token_id, workload, kv, spec.mbp, self.max_num_seqs, desc,
                             self.prefix_caching)
        lm, tok = self.model("engine")
        config = EngineConfig(policy=spec.policy, max_batch_prefill_tokens=spec.mbp,
                              max_batch_total_tokens=kv, block_size=self.block_size,
                              max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.prefix_caching,
                              compile_decode_attention=self.compile_decode_attention, overlap=spec.overlap)
        engine = Engine(lm, tok, config)
        engine.generate([[5, 6, 7, 8] * 4] * 2, _greedy(4))  # warm-up
        engine.iterations.clear()
        traces = run_engine(engine, workload, desc)
        its = list(engine.iterations)
        info = {"max_batch_total_tokens": kv, "max_num_seqs": self.max_num_seqs,
                "iterations": len(its), "preemptions": sum(i.num_preempted for i in its),
                "max_iteration_s": max((i.duration for i in its), default=0.0),
                "mean_decode_batch": float(np.mean([i.num_decode_tokens for i in its])) if its else 0.0}
        return traces, info


# ---- output -----------------------------------------------------------------------------

METRICS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tbt_max_s")


def median_row(runs: list[dict]) -> dict:
    """Per metric, the median over repeats (each repeat's row is kept under 'repeats')."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = float(np.median([r[key] for r in runs]))
    if len(runs) > 1:
        row["repeats"] = [{k: r[k] for k in METRICS} for r in runs]
    return row


def format_table(header: list[str], rows: list[dict]) -> str:
    lines = header + [f"{'system':<22}{'MBP':>6}{'out tok/s':>11}{'TTFT p50 s':>12}{'TTFT p99 s':>12}"
                      f"{'TBT p50 ms':>12}{'TBT p99 ms':>12}{'TBT max ms':>12}"]
    for r in rows:
        mbp = str(r["mbp"]) if r.get("mbp") else "-"
        if "error" in r:
            lines.append(f"{r['system']:<22}{mbp:>6}  {r['error']}")
            continue
        lines.append(f"{r['system']:<22}{mbp:>6}{r['output_tok_s']:>11.1f}{r['ttft_p50_s']:>12.2f}"
                     f"{r['ttft_p99_s']:>12.2f}{1e3 * r['tbt_p50_s']:>12.1f}{1e3 * r['tbt_p99_s']:>12.1f}"
                     f"{1e3 * r['tbt_max_s']:>12.1f}")
    return "\n".join(lines)


def workload_header(w: Workload, kv: int, max_num_seqs: int) -> list[str]:
    s = w.summary()
    rate = s["settings"].get("poisson_rate")
    arrivals = ("all at t=0" if s["last_arrival_s"] == 0 else
                f"{f'Poisson arrivals at {rate:g} req/s' if rate else 'arrivals'} over "
                f"{s['last_arrival_s']:.1f} s (wall clock)")
    return [f"[{w.name}] {s['num_requests']} requests, prompt p50 {s['prompt_len_p50']:.0f} / max "
            f"{s['prompt_len_max']}, output p50 {s['output_len_p50']:.0f} / max {s['output_len_max']} "
            f"tokens, {arrivals}",
            f"  KV capacity {kv} tokens for every system (= {HF_BATCH} x longest prompt+output, what "
            f"padded batches of {HF_BATCH} hold); engine max_num_seqs {max_num_seqs}",
            "  MBP: the engine's max_batch_prefill_tokens (stall_free: chunk budget incl. decodes; "
            "static/dynamic: whole longest prompt); hf_generate_batch: its max_batch_tokens"]


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, as ratios measured in this run."""
    by = {(r["workload"], r["system"]): r for r in rows if "error" not in r}

    def ratio(w: str, a: str, b: str, metric: str) -> float | None:
        ra, rb = by.get((w, a)), by.get((w, b))
        return ra[metric] / rb[metric] if ra and rb and rb[metric] else None

    checks = [("chat", "engine_stall_free", "hf_generate_static16", "output_tok_s", ">=", 4.0),
              ("chat", "engine_stall_free", "hf_generate_batch", "output_tok_s", ">=", 1.5),
              ("chat_poisson", "engine_stall_free", "hf_generate_batch", "output_tok_s", ">=", 1.5),
              ("long_prompt", "engine_stall_free", "engine_dynamic", "tbt_p99_s", "<=", 1 / 3),
              ("long_prompt", "engine_stall_free", "engine_dynamic", "output_tok_s", ">=", 0.9),
              ("long_context", "engine_stall_free", "hf_generate_batch", "output_tok_s", ">=", 1.5)]
    out = []
    for w, a, b, metric, op, target in checks:
        value = ratio(w, a, b, metric)
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        out.append({"workload": w, "ratio": f"{a} / {b} {metric}", "value": value,
                    "target": f"{op} {target:.3g}", "met": met})
    return out


def format_targets(targets: list[dict]) -> str:
    lines = ["Targets (ratios from this run):"]
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  [{t['workload']}] {t['ratio']} = {v} (target {t['target']}): {verdict}")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("loadtests.bench.engine", __doc__, quick="smaller workloads (a few minutes)",
                     threads=2, repeats=1)
    p.add_argument("--prompts", choices=PROMPT_SOURCES,
                   help="chat and chat_poisson prompts: random ids, or real chat prompts in the model's "
                        "template (default: random on embedded:tiny/mid, real on real models); "
                        "long_prompt and long_context always send random ids")
    p.add_argument("--prefix-caching", action="store_true",
                   help="the engine's prefix cache and generate_batch's block sharing (off: every "
                        "system computes every prompt token; real prompts share a system prompt)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of workloads to run")
    p.add_argument("--chat-mbp", type=int, default=512,
                   help="stall_free chunk budget (and HF CB max_batch_tokens) on chat and chat_poisson")
    p.add_argument("--long-mbp", type=int, default=256, help="stall_free chunk budget on long_prompt")
    p.add_argument("--context-mbp", type=int, default=512,
                   help="stall_free chunk budget (and HF CB max_batch_tokens) on long_context")
    p.add_argument("--long-baselines", action="store_true", help="also run the HF baselines on long_prompt")
    p.add_argument("--chat-requests", type=int, help="override the chat (and chat_poisson) size")
    p.add_argument("--poisson-rate", type=float,
                   help=f"chat_poisson arrivals, req/s (default {POISSON_RATE['quick']:g} quick, "
                        f"{POISSON_RATE['full']:g} full)")
    p.add_argument("--long-shorts", type=int, help="override the number of short requests in long_prompt")
    p.add_argument("--context-longs", type=int, default=2, help="long-context requests in long_context")
    p.add_argument("--context-shorts", type=int, help="override the number of short requests in long_context")
    p.add_argument("--systems", help="comma-separated subset of system names to run")
    p.add_argument("--overlap", action="store_true",
                   help="also run stall_free with the overlapped loop (engine_stall_free_overlap)")
    p.add_argument("--compile-decode-attention", action="store_true",
                   help="the engine systems with EngineConfig.compile_decode_attention")
    args = p.parse_args(argv)
    args.prompts = args.prompts or default_prompt_source(args.model)
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        p.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    runner = Runner(args.model, args.block_size, args.max_num_seqs, args.compile_decode_attention,
                    args.prefix_caching)
    lm, tok = runner.model("engine")
    vocab = lm.get_output_embeddings().weight.shape[0]
    pool = ChatPromptPool.from_tokenizer(tok, args.seed) if args.prompts == "real" else None
    workloads = build_workloads(vocab, list(tok.all_special_ids), args.quick, args.seed,
                                chat_requests=args.chat_requests, long_shorts=args.long_shorts,
                                poisson_rate=args.poisson_rate, context_longs=args.context_longs,
                                context_shorts=args.context_shorts, pool=pool)
    workloads = [w for w in workloads if w.name in args.workloads.split(",")]
    chosen = set(args.systems.split(",")) if args.systems else None
    mbps = {"chat": args.chat_mbp, "chat_poisson": args.chat_mbp, "long_prompt": args.long_mbp,
            "long_context": args.context_mbp}
    plan = []
    for w in workloads:
        specs = systems_for(w, mbps[w.name], baselines=w.name != "long_prompt" or args.long_baselines,
                            overlap=args.overlap)
        plan += [(w, s) for s in specs if chosen is None or s.name in chosen]

    runs: dict[tuple[str, str], list[dict]] = {}
    started = time.perf_counter()
    for rep in range(args.repeats):
        # Rotate the order each repeat so no system always runs first (or last) on a noisy box.
        order = plan[rep % len(plan):] + plan[:rep % len(plan)] if plan else []
        for w, spec in tqdm(order, desc=f"systems (repeat {rep + 1}/{args.repeats})", unit="run"):
            row = {"workload": w.name, "system": spec.name, "kind": spec.kind, "policy": spec.policy,
                   "mbp": spec.mbp, "loadavg_1m": os.getloadavg()[0]}
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                traces, info = runner.run(spec, w)
                row |= summarize(traces) | info | {"wall_s": time.perf_counter() - wall,
                                                   "cpu_s": time.process_time() - cpu}
            except Exception as exc:  # a baseline that cannot run here is reported, not fatal
                row["error"] = f"failed: {type(exc).__name__}: {exc}"[:300]
            runs.setdefault((w.name, spec.name), []).append(row)
    rows = [median_row(r) for r in runs.values()]

    header = [f"Engine benchmark: {args.model}, {args.prompts} chat prompts, torch {torch.__version__} "
              f"on {torch.get_num_threads()} threads, transformers {transformers.__version__}, seed {args.seed}, "
              f"{'quick' if args.quick else 'full'} run, {args.repeats} repeat(s), medians"
              + (", engine decode attention compiled" if args.compile_decode_attention else "")
              + (", prefix caching on" if args.prefix_caching else "")]
    tables = []
    for w in workloads:
        wrows = [r for r in rows if r["workload"] == w.name]
        if wrows:
            tables.append(format_table(
                workload_header(w, kv_capacity(w, args.block_size), args.max_num_seqs), wrows))
    targets = check_targets(rows)
    text = "\n".join(header) + "\n\n" + "\n\n".join(tables) + "\n\n" + format_targets(targets)
    result = {"command": " ".join(["python -m loadtests.bench.engine", *(argv if argv is not None else sys.argv[1:])]),
              "config": {**vars(args), "real_prompt_lens": pool.summary() if pool else None,
                         "hf_batch": HF_BATCH, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version(),
                         "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - started},
              "workloads": {w.name: w.summary() for w in workloads},
              "rows": rows, "targets": targets}
    return report(text, result, args.json)


if __name__ == "__main__":
    main()
