"""The device probe (`python3 -m loadtests.device.check --probe --out F`): in under a minute, does
the GPU path start, compile only at start, and agree with HF? Run it before the full check.

Stages, each within what is left of one deadline (cut inside, not only between stages), each
error caught and recorded, and F rewritten after every one (a killed run keeps what finished):

1. `device`: name, SMs, free memory, peak bandwidth and its source, torch / transformers /
   triton versions (transformers from the carried wheels, as traced here, or the image's own).
2. `layout 4:1`, `layout 9:3`, `layout 1:1` (4:1 GQA as Llama-3.2-1B, 9:3 as SmolLM2, 1:1): a
   two-layer Llama of that layout with random fp32 weights, ONE engine (the default block size:
   64 on CUDA, 16 on CPU) on the flex path with
   decode graphs (inductor on CUDA; on CPU, dynamo's eager backend: the same graphs and guards,
   no code) that compiles every shape group and bucket at start, with the Triton block sizes
   inductor picks (`kernels.flex_choices`); a schedule of staggered requests (one row alone,
   mixed passes, chunked prefill with context, every bucket) in a KV cache small enough that it
   preempts; compiles after warm-up and graph breaks; every prompt's greedy tokens against HF.
3. `decode_attention` (CUDA): the decode attention alone (B=64, 1k context, 32/8 heads) with pages
   of 64 slots (the flex default on CUDA) and 16, with and without full pages marked
   (attention_flex.DECODE_FULL_BLOCKS).

The JSON's `probe`: `stages` (each with status complete / cut / error / skipped, seconds, and
its figures), and the verdict so far: compiles_after_warmup, graph_breaks, fallback,
parity_passed, seconds, finished.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from loadtests.device.kernels import flex_choices
from loadtests.device.peak import peak_bandwidth
from loadtests.device.record import release, run_limited, save_json
from replicas import Engine, EngineConfig, SamplingParams
from replicas.loading.models import build_tokenizer

LAYOUTS = {"4:1": (32, 8), "9:3": (9, 3), "1:1": (4, 4)}
SCHEDULE_LENS = (1, 70, 5, 33, 150, 12, 9, 64)
KV_TOKENS = 320  # the schedule's KV: tight enough that it preempts (one engine tests both)
DEADLINE_S = {"cuda": 55.0, "cpu": 600.0}  # the whole probe, stages cut inside at it (on CPU a rehearsal
# of the code paths on a shared machine: its time means nothing)


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


def probe_layout(name: str, device: torch.device, head_dim: int, rec: dict[str, Any]) -> None:
    """One engine for the layout, its KV tight enough that the schedule preempts; `rec` filled as
    it goes (a cut stage keeps what it had)."""
    heads, kv_heads = LAYOUTS[name]
    rec["heads"] = f"{heads}/{kv_heads}"
    model, tokenizer = probe_model(heads, kv_heads, head_dim, device)
    backend = "inductor" if device.type == "cuda" else "eager"
    config = EngineConfig(max_batch_prefill_tokens=64, max_num_seqs=8, attention_backend="flex",
                          cuda_graphs=True, compile_backend=backend, max_batch_total_tokens=KV_TOKENS)
    breaks = _graph_breaks()
    t0 = time.perf_counter()
    with flex_choices() as kernels:
        engine = Engine(model, tokenizer, config)
    runner = engine.runner
    rec.update(path=runner.path, fallback_error=runner.fallback_error, warmup_s=round(time.perf_counter() - t0, 2),
               compiles_at_warmup=runner.compiles[0], kernel_choices=kernels, block_size=engine.blocks.block_size)
    if device.type == "cuda":
        rec["free_gib_after_warmup"] = round(torch.cuda.mem_get_info(device)[0] / 2**30, 2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in SCHEDULE_LENS]
    got = schedule(engine, prompts)
    rec["preemptions"] = sum(it.num_preempted for it in engine.iterations)
    rec["compiles_after_warmup"] = runner.compiles[1]
    rec["graph_breaks"] = _graph_breaks() - breaks
    # parity: every prompt's greedy tokens (preempted ones included) against HF generate
    want = {f"r{i}": hf_greedy(model, p, 6 + 3 * i) for i, p in enumerate(prompts)}
    rec["parity_equal"] = sum(got.get(k) == v for k, v in want.items())
    rec["parity_prompts"] = len(want)


def _graph_breaks() -> int:
    return int(sum(torch._dynamo.utils.counters["graph_break"].values()))


def decode_attention_times(device: torch.device, rec: dict[str, Any]) -> None:
    """The decode attention call alone at B=64, 1k context, 32/8 heads of 64, compiled, its pages
    shuffled in a pool of 128k slots: us per call with pages of 16 and of 64 slots (a page is a KV
    tile: 64 tiles a row or 16), each with every page partial and with full pages marked. `rec`
    gets each case as it finishes."""
    import numpy as np

    from replicas.execution.attention_flex import PageMap, decode_block_mask, decode_lists, flex_call, kernel_options

    b, ctx, heads, kv_heads, d, slots = 64, 1021, 32, 8, 64, 1 << 17
    rec.update(batch=b, context=ctx, kv_gb=2 * b * ctx * kv_heads * d * 2 / 1e9)
    q = torch.randn(b, heads, 1, d, dtype=torch.bfloat16, device=device)
    rows = torch.arange(b, device=device)
    pos = torch.full((b,), ctx - 1, device=device)
    kc = torch.randn(slots, kv_heads, d, dtype=torch.bfloat16, device=device)
    vc = torch.randn_like(kc)
    for bs in (64, 16):
        pages = slots // bs
        npg = -(-ctx // bs)
        table = np.random.default_rng(0).permutation(pages)[:b * npg].reshape(b, npg)
        pm = PageMap(b + 1, pages, device)
        for r in range(b):
            pm.table[r, torch.as_tensor(table[r], device=device)] = torch.arange(npg, dtype=torch.int32,
                                                                                 device=device)
        for full in (False, True):
            lists = {k: torch.as_tensor(v, device=device) for k, v in
                     decode_lists(table, list(range(b)), [ctx] * b, bs, full_blocks=full).items()}
            mask = decode_block_mask(lists, pm.table, rows, pos, bs, slots)
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
            rec[f"page{bs}_{'full' if full else 'partial'}"] = {
                "us": round(us, 1), "gb_per_s": round(rec["kv_gb"] / (us / 1e6), 1), "tiles_per_row": npg}


def run_probe(device: torch.device, layouts: tuple[str, ...] = tuple(LAYOUTS), deadline_s: float | None = None,
              out: str | None = None, meta: dict[str, Any] | None = None,
              peak_tbs: float | None = None) -> dict[str, Any]:
    """Stages in turn (the device's facts, each layout, the decode attention on CUDA), each
    within what is left of the deadline; `out` rewritten after every stage."""
    started = time.perf_counter()
    deadline_s = DEADLINE_S[device.type] if deadline_s is None else deadline_s
    head_dim = 64 if device.type == "cuda" else 16
    probe: dict[str, Any] = {"deadline_s": deadline_s, "stages": {}, "finished": False}
    result = {"meta": meta or {}, "probe": probe}
    work: list[tuple[str, Any]] = [("device", lambda rec: device_facts(device, rec, peak_tbs))]
    work += [(f"layout {name}", lambda rec, name=name: probe_layout(name, device, head_dim, rec)) for name in layouts]
    if device.type == "cuda":
        work.append(("decode_attention", lambda rec: decode_attention_times(device, rec)))
    for stage, fn in work:
        rec = probe["stages"][stage] = {}
        left = deadline_s - (time.perf_counter() - started)
        if left <= 0:
            rec["status"] = "skipped"
        else:
            run_limited(fn, rec, left)
        release(device)
        summarize(probe)
        probe["seconds"] = round(time.perf_counter() - started, 2)
        save_json(out, result)
    probe["finished"] = True
    save_json(out, result)
    return result


def summarize(probe: dict[str, Any]) -> None:
    """The probe's verdict over the layouts so far: compiles after warm-up, graph breaks, any
    fallback, parity (every layout complete and equal to HF)."""
    layouts = [r for k, r in probe["stages"].items() if k.startswith("layout ")]
    done = [r for r in layouts if "parity_prompts" in r]
    probe["compiles_after_warmup"] = sum(r.get("compiles_after_warmup", 0) for r in layouts)
    probe["graph_breaks"] = sum(r.get("graph_breaks", 0) for r in layouts)
    probe["fallback"] = any(r.get("path", "flex+graphs") != "flex+graphs" for r in layouts)
    probe["parity_passed"] = bool(done) and len(done) == len(layouts) and all(
        r["parity_equal"] == r["parity_prompts"] for r in done)


def device_facts(device: torch.device, rec: dict[str, Any], peak_tbs: float | None) -> None:
    """What the run stands on: the device, its memory and peak bandwidth, the library versions
    (transformers' above all, and where it came from: the wheels carry the version the graphs
    were traced with here; the image's own is older)."""
    import transformers

    rec.update(device=str(device), torch=torch.__version__, transformers=transformers.__version__,
               transformers_from=str(Path(transformers.__file__).parent.parent))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        rec.update(name=props.name, sms=props.multi_processor_count, memory_gib=round(total / 2**30, 1),
                   free_gib=round(free / 2**30, 1), capability=f"{props.major}.{props.minor}")
        try:
            import triton
            rec["triton"] = triton.__version__
        except ImportError:
            rec["triton"] = None
    rec["peak_bandwidth"] = peak_bandwidth(device, peak_tbs)
