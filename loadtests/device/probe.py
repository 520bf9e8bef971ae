"""The device probe (`python3 -m loadtests.device.check --probe`): in about a minute, does the GPU
path start, compile only at start, and agree with HF? Run it before the full check.

For each head layout the loader accepts (4:1 GQA as Llama-3.2-1B, 9:3 as SmolLM2, 1:1), a
two-layer Llama of that layout with random fp32 weights: an engine on the flex path with decode
graphs (inductor on CUDA; on CPU, dynamo's eager backend: the same graphs and guards, no code),
which compiles every shape group and decode bucket at start; then a schedule of staggered
requests (one row alone, mixed passes, chunked prefill with context, every bucket, preemption)
through it, counting compiles after warm-up; then its greedy tokens against HF `generate`.
Last, when time is left on CUDA, the decode attention alone (B=64, 1k context, 32/8 heads) with
and without full pages marked (attention_flex.DECODE_FULL_BLOCKS).

The JSON's `probe`: compiles_after_warmup and graph_breaks (ints, summed over layouts),
fallback (any layout fell back to SDPA), seconds, and each layout's record.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from replicas import Engine, EngineConfig, SamplingParams
from replicas.models import build_tokenizer

LAYOUTS = {"4:1": (32, 8), "9:3": (9, 3), "1:1": (4, 4)}
SCHEDULE_LENS = (1, 70, 5, 33, 150, 12, 9, 64)


def probe_model(heads: int, kv_heads: int, head_dim: int, device: torch.device) -> tuple[Any, Any]:
    tokenizer = build_tokenizer(2048, 0, 4096)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(hidden_size=heads * head_dim, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=2048, max_position_embeddings=4096, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, dtype="float32")
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    return model.eval().requires_grad_(False), tokenizer


def schedule(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """One prompt alone for three passes, then the others two a pass, outputs of several lengths."""
    tokens: dict[str, list[int]] = {}
    pending, steps = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished():
        if steps == 0 or steps >= 3:
            for i, p in pending[:1 if steps == 0 else 2]:
                engine.add_request(p, SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True),
                                   request_id=f"r{i}")
            pending = pending[1 if steps == 0 else 2:]
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
        steps += 1
    return tokens


@torch.inference_mode()
def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    model.set_attn_implementation("sdpa")
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(ids):].tolist()


def probe_layout(name: str, device: torch.device, head_dim: int) -> dict[str, Any]:
    heads, kv_heads = LAYOUTS[name]
    started = time.perf_counter()
    model, tokenizer = probe_model(heads, kv_heads, head_dim, device)
    backend = "inductor" if device.type == "cuda" else "eager"
    config = dict(max_batch_prefill_tokens=64, block_size=16, max_num_seqs=8, attention_backend="flex",
                  cuda_graphs=True, compile_backend=backend)
    t0 = time.perf_counter()
    engine = Engine(model, tokenizer, EngineConfig(max_batch_total_tokens=2048, **config))
    warm_s = time.perf_counter() - t0
    runner = engine.runner
    record: dict[str, Any] = {"heads": f"{heads}/{kv_heads}", "path": runner.path,
                              "fallback_error": runner.fallback_error, "warmup_s": round(warm_s, 2),
                              "compiles_at_warmup": runner.compiles[0]}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in SCHEDULE_LENS]
    got = schedule(engine, prompts)
    tight = Engine(model, tokenizer, EngineConfig(max_batch_total_tokens=320, **config))  # preempts
    got_tight = schedule(tight, prompts)
    record["preemptions"] = sum(it.num_preempted for it in tight.iterations)
    record["compiles_after_warmup"] = runner.compiles[1] + tight.runner.compiles[1]
    record["same_tokens_under_preemption"] = got == got_tight
    # parity: the first three prompts' greedy tokens against HF generate
    want = {f"r{i}": hf_greedy(model, p, 6 + 3 * i) for i, p in enumerate(prompts[:3])}
    record["parity_equal"] = sum(got[k] == v for k, v in want.items())
    record["parity_prompts"] = len(want)
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def decode_attention_times(device: torch.device) -> dict[str, Any]:
    """The decode attention call alone at B=64, 1k context, 32/8 heads of 64, pages of 16 in a
    shuffled pool, compiled: us per call with every page partial and with full pages marked."""
    import numpy as np

    from replicas.attention_flex import PageMap, decode_block_mask, decode_lists, flex_call, kernel_options

    b, ctx, bs, heads, kv_heads, d = 64, 1021, 16, 32, 8, 64
    pages = 8192
    npg = -(-ctx // bs)
    table = np.random.default_rng(0).permutation(pages)[:b * npg].reshape(b, npg)
    pm = PageMap(b + 1, pages, device)
    for r in range(b):
        pm.table[r, torch.as_tensor(table[r], device=device)] = torch.arange(npg, dtype=torch.int32, device=device)
    kc = torch.randn(pages * bs, kv_heads, d, dtype=torch.bfloat16, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(b, heads, 1, d, dtype=torch.bfloat16, device=device)
    rows = torch.arange(b, device=device)
    pos = torch.full((b,), ctx - 1, device=device)
    out: dict[str, Any] = {"batch": b, "context": ctx, "kv_gb": 2 * b * ctx * kv_heads * d * 2 / 1e9}
    for full in (False, True):
        lists = {k: torch.as_tensor(v, device=device) for k, v in
                 decode_lists(table, list(range(b)), [ctx] * b, bs, full_blocks=full).items()}
        mask = decode_block_mask(lists, pm.table, rows, pos, bs, pages * bs)
        fn = torch.compile(flex_call, dynamic=False)
        args = (q, kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], mask, d ** -0.5, True,
                kernel_options(bs, prefill=False))
        fn(*args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) / 50 * 1e3
        out["full_pages" if full else "all_partial"] = {"us": round(us, 1),
                                                        "gb_per_s": round(out["kv_gb"] / (us / 1e6), 1)}
    return out


def run_probe(device: torch.device, layouts: tuple[str, ...] = tuple(LAYOUTS),
              deadline_s: float = 50.0) -> dict[str, Any]:
    """Each layout in turn while the deadline lasts (those left are listed as skipped)."""
    started = time.perf_counter()
    head_dim = 64 if device.type == "cuda" else 16
    torch._dynamo.utils.counters.clear()
    records: dict[str, Any] = {}
    skipped = []
    for name in layouts:
        if time.perf_counter() - started > deadline_s:
            skipped.append(name)
            continue
        records[name] = probe_layout(name, device, head_dim)
    probe: dict[str, Any] = {
        "compiles_after_warmup": sum(r["compiles_after_warmup"] for r in records.values()),
        "graph_breaks": int(sum(torch._dynamo.utils.counters["graph_break"].values())),
        "fallback": any(r["path"] != "flex+graphs" for r in records.values()),
        "parity_passed": all(r["parity_equal"] == r["parity_prompts"] and r["same_tokens_under_preemption"]
                             for r in records.values()),
        "layouts": records, "skipped": skipped}
    if device.type == "cuda" and time.perf_counter() - started < deadline_s:
        probe["decode_attention"] = decode_attention_times(device)
    probe["seconds"] = round(time.perf_counter() - started, 2)
    return probe
