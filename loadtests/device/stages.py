"""The measurements of the GPU check (loadtests/device/check.py), one function per item of a stage.

Each takes the model, its tokenizer and `build(model, tokenizer, **engine_config) -> Engine` (the
check's engine factory: it carries the runner options and the one engine shape every engine of
the run shares, so the device compiles each graph once: see `RunnerOptions`) and returns one
JSON-ready row. The `*_kv_tokens` functions say what KV each stage needs of that shape. Timings
wait for the device: `Engine.step()` ends by reading the sampled tokens back; the HF references
synchronize after every step.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, StaticCache

from loadtests.bench.decode import cache_kwarg, fill
from replicas.engine import Engine
from replicas.execution.kv_memory import weight_bytes
from replicas.loading.model_support import kv_shape
from replicas.protocol import SamplingParams
from replicas.request import Request

Build = Callable[..., Engine]
# Greedy tokens that differ where HF's top two logits are closer than this are a tie broken by
# rounding (summation order differs between attention kernels), not a wrong token.
NEAR_TIE = 1e-3
FILL_STEPS = 3  # warm-up decodes bench_decode.fill runs before a decode measurement
FILL_TOKENS = 1100  # what fill lets each request generate, with room to spare (KV and length)
WARM_STEPS = 3  # HF reference steps not timed (a compiled step records its graphs in these)


def prompts(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, n).tolist() for n in lengths]


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    layers, kv_heads, head_dim = kv_shape(model.config)
    return 2 * layers * kv_heads * head_dim * next(model.parameters()).element_size()


def rounded(tokens: int, block: int = 16) -> int:
    return -(-tokens // block) * block


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1. parity ----------------------------------------------------------------------------

@torch.inference_mode()
def greedy_parity(model: PreTrainedModel, tokenizer: Any, build: Build, prompt_ids: list[list[int]],
                  new_tokens: int, chunk: int) -> dict[str, Any]:
    """fp32 greedy tokens of the engine (all prompts at once, prefills chunked) vs HF `generate`
    (one prompt at a time, sdpa); EOS masked for both (min tokens = max tokens)."""
    model.set_attn_implementation("sdpa")
    hf = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        hf.append((out.sequences[0, len(ids):].tolist(), out.scores))
    engine = build(model, tokenizer, max_batch_prefill_tokens=chunk)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens,
                                                      temperature=0.0))
    rows = []
    for ids, (tokens, scores), out in zip(prompt_ids, hf, outs):
        first = next((i for i, (a, b) in enumerate(zip(tokens, out.token_ids)) if a != b), None)
        row: dict[str, Any] = {"prompt_tokens": len(ids), "equal": first is None and tokens == out.token_ids,
                               "first_mismatch": first}
        if first is not None:
            top = scores[first][0].float().topk(2).values
            row["hf_top2_gap"] = float(top[0] - top[1])
        rows.append(row)
    ok = all(r["equal"] or r.get("hf_top2_gap", 1.0) < NEAR_TIE for r in rows)
    return {"passed": ok, "new_tokens": new_tokens, "chunk": chunk, "near_tie": NEAR_TIE,
            "equal_prompts": sum(r["equal"] for r in rows), "prompts": rows}


@torch.inference_mode()
def bf16_logprob_error(model32: PreTrainedModel, tokenizer: Any, build: Build,
                       prompt_ids: list[list[int]], new_tokens: int, chunk: int) -> dict[str, Any]:
    """Teacher-forced log-probabilities of the bf16 engine (prompt tokens through chunked
    prefills, generated ones through decodes) and of HF's bf16 forward, each against an fp64
    forward with the same bf16-rounded weights; the engine within 2x of HF's own error."""
    bf16 = copy.deepcopy(model32).to(torch.bfloat16)
    engine = build(bf16, tokenizer, max_batch_prefill_tokens=chunk)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens,
                                                      temperature=0.0, logprobs=0, prompt_logprobs=0))
    del engine
    bf16.set_attn_implementation("sdpa")
    ref = copy.deepcopy(bf16).to(torch.float64)
    errors: dict[str, list[torch.Tensor]] = {"engine": [], "hf_bf16": []}
    for out in outs:
        seq = torch.tensor([out.prompt_token_ids + out.token_ids], device=bf16.device)
        targets = seq[0, 1:, None]

        def logprobs(model: PreTrainedModel, dtype: torch.dtype) -> torch.Tensor:
            logits = model(input_ids=seq, use_cache=False).logits[0, :-1]  # (L - 1, V)
            return logits.to(dtype).log_softmax(-1).gather(1, targets)[:, 0].double()

        exact = logprobs(ref, torch.float64)
        ours = [lp for lp, _ in out.prompt_logprobs] + [lp for lp, _ in out.logprobs]
        errors["engine"].append((torch.tensor(ours, device=exact.device, dtype=torch.float64) - exact).abs())
        errors["hf_bf16"].append((logprobs(bf16, torch.float32) - exact).abs())
    del ref, bf16
    row: dict[str, Any] = {"positions": int(sum(e.numel() for e in errors["engine"]))}
    for name, parts in errors.items():
        e = torch.cat(parts)
        row[f"{name}_mean_abs"], row[f"{name}_max_abs"] = float(e.mean()), float(e.max())
    row["mean_ratio"] = row["engine_mean_abs"] / max(row["hf_bf16_mean_abs"], 1e-12)
    row["passed"] = row["mean_ratio"] <= 2.0
    return row


# ---- 2. decode MBU ------------------------------------------------------------------------

def decode_row(system: str, batch: int, times: list[float], context_tokens: float, model: PreTrainedModel,
               peak_bytes_s: float) -> dict[str, Any]:
    """Bytes a decode step must read (every weight once, every sequence's KV) over its time."""
    step = statistics.median(times)
    read = weight_bytes(model) + context_tokens * kv_bytes_per_token(model)
    return {"system": system, "batch": batch, "step_ms": 1e3 * step, "context_tokens": context_tokens,
            "bytes_per_step": read, "gb_per_s": read / step / 1e9, "mbu": read / step / peak_bytes_s,
            "steps": len(times)}


def decode_kv_tokens(batch: int, context: int) -> int:
    """The KV `engine_decode` needs at `batch` x `context`."""
    return rounded(batch * (context + FILL_TOKENS))


def engine_decode(engine: Engine, batch: int, context: int, steps: int, peak_bytes_s: float) -> dict[str, Any]:
    """The engine's decode step (`Engine.step()`: schedule, forward, sample, postprocess) with
    `batch` requests at `context` tokens each. One engine serves every batch size in turn (its
    decode graphs hold a bucket for each): it is left empty for the next."""
    model = engine.model
    fill(engine, [context] * batch)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    passes = list(engine.iterations)[-steps:]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    row = decode_row("engine", batch, times, statistics.median(p.context_tokens for p in passes), model,
                     peak_bytes_s)
    row["forward_ms"] = 1e3 * statistics.median(p.duration for p in passes)  # the pass without the loop
    return row


@torch.inference_mode()
def hf_decode(model: PreTrainedModel, batch: int, context: int, steps: int, peak_bytes_s: float,
              compiled: bool) -> dict[str, Any]:
    """HF's own decode step over a StaticCache (sdpa, greedy token picked on the device), eager or
    `torch.compile`d (reduce-overhead: CUDA graphs on a GPU; on CPU, a rehearsal, dynamo's eager
    backend as the probe's: the same graphs and guards, no C++ to build); the context grows as it
    decodes."""
    model.set_attn_implementation("sdpa")
    device = model.device
    cache = StaticCache(config=model.config, max_cache_len=context + WARM_STEPS + steps + 1)
    cache_arg = cache_kwarg(model)
    ids = torch.tensor(prompts([context] * batch, model.config.vocab_size, seed=3), device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    forward = model.forward
    if compiled:
        if device.type == "cuda":
            forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        else:
            forward = torch.compile(model.forward, backend="eager", dynamic=False)
    times, first = [], None
    for i in range(WARM_STEPS + steps):
        positions = torch.full((batch, 1), context + i, device=device)
        sync(device)
        t = time.perf_counter()
        out = forward(input_ids=token, position_ids=positions, use_cache=True, **{cache_arg: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        if first is None:
            first = time.perf_counter() - t
        if i >= WARM_STEPS:
            times.append(time.perf_counter() - t)
    context_tokens = batch * (context + WARM_STEPS + (steps + 1) / 2)
    system = "hf_compiled" if compiled else "hf_eager"
    row = decode_row(system, batch, times, context_tokens, model, peak_bytes_s)
    row["first_step_s"] = first  # the compile, for the compiled one
    return row


# ---- 3. prefill ---------------------------------------------------------------------------

def prefill_prompts(total: int, prompt_len: int) -> int:
    return max(1, total // prompt_len)


def prefill_kv_tokens(total: int, prompt_len: int) -> int:
    return rounded(prefill_prompts(total, prompt_len) * (prompt_len + 16))


def prefill_rate(model: PreTrainedModel, tokenizer: Any, build: Build, budget: int, prompt_len: int,
                 total: int, repeats: int) -> dict[str, Any]:
    """Prompt tokens per second through prefill-only passes of at most `budget` tokens: `total`
    tokens in prompts of `prompt_len`, one token generated each; a run first to warm up."""
    n = prefill_prompts(total, prompt_len)
    # one token each: no decode pass, so no decode graph to compile or capture
    engine = build(model, tokenizer, graphs=False, max_batch_prefill_tokens=budget)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs = []
    for r in range(repeats + 1):
        batch = prompts([prompt_len] * n, engine.vocab_size, seed=10 + r)
        engine.iterations.clear()
        t = time.perf_counter()
        engine.generate(batch, params)
        runs.append(time.perf_counter() - t)
    passes = [p for p in engine.iterations if p.num_prefill_tokens]
    elapsed = statistics.median(runs[1:])
    return {"max_batch_prefill_tokens": budget, "prompt_tokens": n * prompt_len, "prompts": n,
            "elapsed_s": elapsed, "tokens_per_s": n * prompt_len / elapsed, "passes": len(passes),
            "pass_tokens_per_s": statistics.median(p.num_prefill_tokens / p.duration for p in passes)}


# ---- 4. stall-free TBT --------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def tbt_kv_tokens(streams: int, context: int, long_len: int, stream_tokens: int) -> int:
    """The KV `tbt_case` needs: every stream to its end, and the long prompt."""
    return rounded(streams * (context + stream_tokens + 16) + long_len + 64)


def tbt_case(model: PreTrainedModel, tokenizer: Any, build: Build, policy: str, budget: int,
             slo_ms: float | None, streams: int, context: int, long_len: int, stream_tokens: int,
             decode_steps: int, deadline: float) -> dict[str, Any]:
    """`streams` requests decoding at `context` tokens, then one `long_len`-token prompt arrives:
    the gaps between the streams' tokens from its arrival until its second token (the pass after
    its prefill, so a stream stalled by it has the gap counted), against the decode-only step time
    measured just before it."""
    engine = build(model, tokenizer, policy=policy, max_batch_prefill_tokens=budget, tbt_slo_ms=slo_ms)
    params = SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts([context] * streams, engine.vocab_size, seed=20)]
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    decode_only = []
    for _ in range(decode_steps):
        t = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - t)
    passes_before = len(engine.iterations)
    long: Request = engine.add_request(prompts([long_len], engine.vocab_size, seed=21)[0],
                                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    arrival = time.perf_counter()
    while len(long.token_times) < 2 and engine.has_unfinished() and time.perf_counter() < deadline:
        engine.step()
    end = time.perf_counter()
    gaps = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:]) if arrival < b <= end]
    window = list(engine.iterations)[passes_before:]
    budgets = [p.prefill_budget for p in window if p.prefill_budget is not None]
    return {"policy": policy, "max_batch_prefill_tokens": budget, "tbt_slo_ms": slo_ms, "streams": streams,
            "context": context, "long_prompt_tokens": long_len, "complete": len(long.token_times) == 2,
            "decode_only_step_ms": 1e3 * statistics.median(decode_only),
            "tbt_p50_ms": 1e3 * percentile(gaps, 50), "tbt_p99_ms": 1e3 * percentile(gaps, 99),
            "tbt_max_ms": 1e3 * max(gaps), "gaps": len(gaps), "passes": len(window),
            "stalled": sum(p.num_stalled for p in window),
            "long_ttft_s": (long.token_times[0] - arrival) if long.token_times else None,
            "median_prefill_budget": statistics.median(budgets) if budgets else None}
