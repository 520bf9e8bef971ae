"""The engine's device check for one lent GPU: parity, decode MBU, prefill rate, stall-free TBT.

Prepare the wheels the bare image lacks (here, with the network; loadtests/device/wheels.py says how
the list is found; it carries the transformers the graphs were traced with), then on the device,
from the repository root (one call: the probe under a minute, the check under 5 minutes):

    python -m loadtests.device.check --wheels loadtests/out/gpu_wheels
    python3 -m pip install -q --no-index --no-deps --target /tmp/site loadtests/out/gpu_wheels/*.whl && \\
        export PYTHONPATH=/tmp/site && python3 -m loadtests.device.check --probe --out $OUT/gpu_probe.json && \\
        python3 -m loadtests.device.check --out $OUT/gpu_check.json

(device `run`: carry ["loadtests/out/gpu_wheels"], timeout_s 420; the image has `python3`, no
`python`). The probe (`--probe`, loadtests/device/probe.py) runs first: if it shows compiles
after warm-up, a fallback or a parity miss, fix that before the full check. Both rewrite their
JSON after every stage (a `run` killed at its limit still returns what finished).
Rehearsals on CPU: `python -m loadtests.device.check --device cpu --small [--probe] --out PATH`.

The model is Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192,
vocab 128256, tied embeddings, rope theta 500000) with random weights made on the device, and a
byte-level BPE tokenizer trained here (replicas.loading.models.build_tokenizer): no hub. Stages:

1. parity: fp32 greedy tokens of the engine vs HF `generate`; bf16 teacher-forced log-probabilities
   of the engine and of HF, each against fp64 with the same weights (the engine within 2x of HF).
2. mbu: decode memory-bandwidth utilisation (weights + KV read per step / step time / the peak) at
   B = 1 / 16 / 64 with 1k context: the engine, HF StaticCache eager, HF torch.compile'd.
3. prefill: prompt tokens/s at max_batch_prefill_tokens 512 / 2048 / 8192.
4. tbt: 63 streams decoding when a 16k-token prompt arrives: the streams' p50/p99 TBT and the
   decode-only step, under stall_free, stall_free with the SLO budget, and dynamic.

Each stage has a time budget inside one deadline for the run: the item running when it ends is
cut (listed under `cut`), those after it are skipped; the JSON (`--out`) is rewritten after every
item. Every engine shares one shape (KV size, max_num_seqs, max_model_len: `engine_shape`), so
the device compiles each graph once and later engines take it from inductor's cache; one engine
serves every batch size of the decode stage, and the prefill stage captures no decode graph.
MBU is taken against the device's own peak (`peak.py`: its datasheet figure, else a measured
copy), recorded with its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from loadtests.device import stages
from loadtests.device.peak import peak_bandwidth
from loadtests.device.record import release, run_limited, save_json
from loadtests.device.runner import RunnerOptions
from replicas.loading.models import build_tokenizer

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072}
SMALL = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 4096}
ROPE_THETA = 500_000.0
# The performance stages run in bf16 on a GPU, as served; on CPU in fp32 (the engine's CPU default:
# CPU bf16 matmuls are slow, and the rehearsal is about the code paths).
PERF_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
SLO_OVER_DECODE = 2.5  # without --tbt-slo-ms: the SLO is this many decode-only steps of stall_free


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of every stage, and each stage's time budget in seconds."""

    shape: dict[str, int]
    parity_lengths: tuple[int, ...]
    parity_new_tokens: int
    parity_chunk: int
    mbu_batches: tuple[int, ...]
    mbu_context: int
    mbu_steps: int
    compiled_batches: tuple[int, ...]
    prefill_budgets: tuple[int, ...]
    prefill_prompt_len: int
    prefill_tokens: int
    prefill_repeats: int
    tbt_streams: int
    tbt_context: int
    tbt_long: int
    tbt_stream_tokens: int
    tbt_budget: int
    tbt_decode_steps: int
    budgets_s: dict[str, float]
    deadline_s: float  # the whole run, model build included


FULL = Plan(
    shape=LLAMA_1B, parity_lengths=(7, 64, 200, 333), parity_new_tokens=32, parity_chunk=128,
    mbu_batches=(1, 16, 64), mbu_context=1024, mbu_steps=30, compiled_batches=(64,),
    prefill_budgets=(512, 2048, 8192), prefill_prompt_len=4096, prefill_tokens=32768, prefill_repeats=2,
    tbt_streams=63, tbt_context=1024, tbt_long=16384, tbt_stream_tokens=1024, tbt_budget=2048,
    tbt_decode_steps=20, budgets_s={"parity": 50, "mbu": 100, "prefill": 40, "tbt": 90}, deadline_s=295)
SMALL_PLAN = Plan(
    shape=SMALL, parity_lengths=(5, 24, 70, 131), parity_new_tokens=24, parity_chunk=32,
    mbu_batches=(1, 4, 16), mbu_context=128, mbu_steps=5, compiled_batches=(1,),
    prefill_budgets=(64, 256, 1024), prefill_prompt_len=512, prefill_tokens=2048, prefill_repeats=1,
    tbt_streams=63, tbt_context=32, tbt_long=1024, tbt_stream_tokens=256, tbt_budget=128,
    tbt_decode_steps=5, budgets_s={"parity": 60, "mbu": 90, "prefill": 60, "tbt": 60}, deadline_s=300)


def build_model(shape: dict[str, int], device: torch.device, seed: int = 0) -> tuple[LlamaForCausalLM, Any]:
    """fp32 Llama of `shape` with random weights made on `device`, and a tokenizer trained here."""
    tokenizer = build_tokenizer(shape["vocab_size"], seed, shape["max_position_embeddings"])
    eos = tokenizer.eos_token_id
    config = LlamaConfig(**shape, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, dtype="float32")
    torch.manual_seed(seed)
    with device:
        model = LlamaForCausalLM(config)
    return model.eval().requires_grad_(False), tokenizer


class Check:
    """The run's record: rewritten to `path` after every item, so a cut run keeps what finished."""

    def __init__(self, path: str | None, meta: dict[str, Any], deadline: float, device: torch.device) -> None:
        self.path, self.deadline, self.device = path, deadline, device
        self.result: dict[str, Any] = {"meta": meta, "stages": {}}

    def save(self) -> None:
        save_json(self.path, self.result)

    def stage(self, name: str, budget_s: float) -> Stage:
        return Stage(self, name, budget_s)


class Stage:
    """A stage's items, each cut when the stage's budget (or the run's deadline) runs out: an item
    running at the end is interrupted (listed under `cut`), those after it are skipped."""

    def __init__(self, check: Check, name: str, budget_s: float) -> None:
        self.check, self.start = check, time.perf_counter()
        self.end = min(self.start + budget_s, check.deadline)
        self.record: dict[str, Any] = {"budget_s": budget_s, "items": {}, "skipped": [], "cut": [], "errors": {}}
        check.result["stages"][name] = self.record

    def left(self) -> float:
        return self.end - time.perf_counter()

    def run(self, item: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        row = None
        if self.left() <= 0:
            self.record["skipped"].append(item)
        else:
            out: dict[str, Any] = {}
            status = run_limited(lambda rec: rec.update(row=fn()), out, self.left())
            if status == "complete":
                row = self.record["items"][item] = out["row"]
            elif status == "cut":
                self.record["cut"].append(item)
                print(f"{item}: cut at the stage's budget", file=sys.stderr)
            else:  # recorded, and the run goes on: one failure must not cost the rest
                self.record["errors"][item] = out["error"]
                print(f"{item}: {out['error']}", file=sys.stderr)
        release(self.check.device)
        self.record["elapsed_s"] = time.perf_counter() - self.start
        self.record["status"] = ("errors" if self.record["errors"] else "cut" if self.record["cut"] else
                                 "stopped_early" if self.record["skipped"] else "complete")
        self.check.save()
        return row


def engine_shape(plan: Plan, parity_kv: int) -> dict[str, Any]:
    """The EngineConfig fields every engine of the run shares: room for the largest stage."""
    kv = max(parity_kv, stages.decode_kv_tokens(max(plan.mbu_batches), plan.mbu_context),
             stages.prefill_kv_tokens(plan.prefill_tokens, plan.prefill_prompt_len),
             stages.tbt_kv_tokens(plan.tbt_streams, plan.tbt_context, plan.tbt_long, plan.tbt_stream_tokens))
    model_len = max(plan.mbu_context + stages.FILL_TOKENS, plan.prefill_prompt_len + 16, plan.tbt_long + 16,
                    plan.tbt_context + plan.tbt_stream_tokens + 16, max(plan.parity_lengths) + plan.parity_new_tokens)
    seqs = max(max(plan.mbu_batches), plan.tbt_streams + 1, len(plan.parity_lengths),
               stages.prefill_prompts(plan.prefill_tokens, plan.prefill_prompt_len))
    return {"max_batch_total_tokens": kv, "max_model_len": model_len, "max_num_seqs": seqs,
            "enable_prefix_caching": False}


def run_stages(model: LlamaForCausalLM, tokenizer: Any, plan: Plan, check: Check, runner: RunnerOptions,
               peak_bytes_s: float, slo_ms: float | None, only: set[str], perf_dtype: torch.dtype) -> None:
    build = runner.build
    vocab = model.config.vocab_size
    ids = stages.prompts(plan.parity_lengths, vocab, seed=1)
    runner.shape = engine_shape(plan, stages.rounded(sum(len(p) + plan.parity_new_tokens + 16 for p in ids)))
    check.result["meta"]["engine_shape"] = runner.shape
    if "parity" in only:
        s = check.stage("parity", plan.budgets_s["parity"])
        s.run("greedy_fp32", lambda: stages.greedy_parity(model, tokenizer, build, ids, plan.parity_new_tokens,
                                                          plan.parity_chunk))
        s.run("teacher_forced_bf16", lambda: stages.bf16_logprob_error(
            model, tokenizer, build, ids, plan.parity_new_tokens // 2, plan.parity_chunk))
    model.to(perf_dtype)
    if "mbu" in only:
        s = check.stage("mbu", plan.budgets_s["mbu"])
        args = (plan.mbu_context, plan.mbu_steps, peak_bytes_s)
        # one engine, a decode bucket per batch size, for every batch size
        engine = None

        def decode(b: int) -> dict[str, Any]:
            nonlocal engine
            if engine is None:
                engine = build(model, tokenizer, graphs=plan.mbu_batches, max_batch_prefill_tokens=8192)
            return stages.engine_decode(engine, b, *args)

        for b in plan.mbu_batches:
            s.run(f"engine B={b}", lambda b=b: decode(b))
        engine = None
        for b in plan.mbu_batches:
            s.run(f"hf_eager B={b}", lambda b=b: stages.hf_decode(model, b, *args, compiled=False))
        for b in plan.compiled_batches:
            s.run(f"hf_compiled B={b}", lambda b=b: stages.hf_decode(model, b, *args, compiled=True))
    if "prefill" in only:
        s = check.stage("prefill", plan.budgets_s["prefill"])
        for budget in plan.prefill_budgets:
            s.run(f"mbp={budget}", lambda budget=budget: stages.prefill_rate(
                model, tokenizer, build, budget, plan.prefill_prompt_len, plan.prefill_tokens,
                plan.prefill_repeats))
    if "tbt" in only:
        s = check.stage("tbt", plan.budgets_s["tbt"])

        def case(policy: str, budget: int, slo: float | None) -> Callable[[], dict[str, Any]]:
            return lambda: stages.tbt_case(model, tokenizer, build, policy, budget, slo, plan.tbt_streams,
                                           plan.tbt_context, plan.tbt_long, plan.tbt_stream_tokens,
                                           plan.tbt_decode_steps, s.end)

        plain = s.run("stall_free", case("stall_free", plan.tbt_budget, None))
        if slo_ms is None and plain is not None:
            slo_ms = SLO_OVER_DECODE * plain["decode_only_step_ms"]
        if slo_ms is not None:
            s.run("stall_free+slo", case("stall_free", plan.tbt_budget, round(slo_ms, 3)))
        # dynamic prefills a prompt whole: its budget must hold the long prompt
        s.run("dynamic", case("dynamic", max(plan.tbt_budget, plan.tbt_long), None))


def table(result: dict[str, Any]) -> str:
    st = result["stages"]
    lines = [f"GPU check on {result['meta']['device_name']} ({result['meta']['shape_name']} model), "
             f"runner {result['meta']['runner']}"]
    for name, rec in st.items():
        lines.append(f"[{name}] {rec.get('status')} in {rec.get('elapsed_s', 0):.1f} s of {rec['budget_s']} s"
                     + (f"; skipped {rec['skipped']}" if rec["skipped"] else "")
                     + (f"; errors in {list(rec['errors'])}" if rec["errors"] else ""))
        items = rec["items"]
        if name == "parity":
            g, b = items.get("greedy_fp32"), items.get("teacher_forced_bf16")
            if g:
                lines.append(f"  fp32 greedy: {g['equal_prompts']}/{len(g['prompts'])} prompts equal to HF, "
                             f"passed {g['passed']}")
            if b:
                lines.append(f"  bf16 |logprob - fp64|: engine {b['engine_mean_abs']:.2e} (max "
                             f"{b['engine_max_abs']:.2e}), HF {b['hf_bf16_mean_abs']:.2e} (max "
                             f"{b['hf_bf16_max_abs']:.2e}), ratio {b['mean_ratio']:.2f}, passed {b['passed']}")
        elif name == "mbu":
            lines.append(f"  {'system':<14}{'B':>4}{'step ms':>10}{'GB/s':>9}{'MBU':>7}")
            lines += [f"  {r['system']:<14}{r['batch']:>4}{r['step_ms']:>10.2f}{r['gb_per_s']:>9.1f}"
                      f"{r['mbu']:>7.3f}" for r in items.values()]
        elif name == "prefill":
            lines.append(f"  {'MBP':>6}{'tokens/s':>12}{'per pass':>12}{'passes':>8}")
            lines += [f"  {r['max_batch_prefill_tokens']:>6}{r['tokens_per_s']:>12.0f}"
                      f"{r['pass_tokens_per_s']:>12.0f}{r['passes']:>8}" for r in items.values()]
        elif name == "tbt":
            lines.append(f"  {'case':<16}{'MBP':>6}{'SLO ms':>8}{'decode ms':>10}{'p50 ms':>8}{'p99 ms':>8}"
                         f"{'stalled':>8}{'long TTFT s':>12}")
            for key, r in items.items():
                ttft = "-" if r["long_ttft_s"] is None else f"{r['long_ttft_s']:.3f}"
                slo = "-" if r["tbt_slo_ms"] is None else f"{r['tbt_slo_ms']:.1f}"
                lines.append(f"  {key:<16}{r['max_batch_prefill_tokens']:>6}{slo:>8}"
                             f"{r['decode_only_step_ms']:>10.2f}{r['tbt_p50_ms']:>8.2f}{r['tbt_p99_ms']:>8.2f}"
                             f"{r['stalled']:>8}{ttft:>12}")
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _meta(device: torch.device, plan: Plan, small: bool, bandwidth: dict[str, Any],
          runner: RunnerOptions) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": str(device), "device_name": name, "shape_name": "small" if small else "llama-3.2-1b",
            "shape": plan.shape, "rope_theta": ROPE_THETA, "tied_embeddings": True, "peak_tbs": bandwidth["tbs"],
            "peak_bandwidth": bandwidth,
            "perf_dtype": str(PERF_DTYPE[device.type]), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "commit": _commit(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "runner": runner.record(), "plan": dataclasses.asdict(plan) | {"shape": None}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m loadtests.device.check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto: cuda when visible, else cpu")
    p.add_argument("--small", action="store_true", help="a tiny model of the same family (CPU rehearsal)")
    p.add_argument("--out", default=None, help="the JSON, rewritten after every item")
    p.add_argument("--stages", default="parity,mbu,prefill,tbt")
    p.add_argument("--peak-tbs", type=float, default=None,
                   help="peak memory bandwidth, TB/s; default: the device's datasheet figure, else a measured copy")
    p.add_argument("--tbt-slo-ms", type=float, default=None,
                   help=f"the stall_free+slo case's SLO; default {SLO_OVER_DECODE} x stall_free's decode step")
    p.add_argument("--attention-backend", default=None, help="the runner's attention_backend, when it has one")
    p.add_argument("--cuda-graphs", default=None, action=argparse.BooleanOptionalAction,
                   help="the runner's cuda_graphs, when it has one")
    p.add_argument("--compile-backend", default=None,
                   help="the runner's compile_backend (CPU rehearsal of the compiled path: eager)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads; default: 1 on CPU, torch's choice on a GPU")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiplies every stage budget and the deadline")
    p.add_argument("--probe", action="store_true",
                   help="the one-minute probe only (loadtests/device/probe.py): compiles, fallback, parity")
    p.add_argument("--probe-deadline-s", type=float, default=None,
                   help="the probe's deadline (default 55 s on CUDA, 600 s on CPU)")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="download the wheels the GPU image lacks into DIR and exit")
    args = p.parse_args(argv)
    if args.wheels:
        from loadtests.device import wheels as gpu_wheels
        return {"wheels": [str(w) for w in gpu_wheels.download(args.wheels)]}
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.probe:
        from loadtests.device.probe import LAYOUTS, run_probe
        meta = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
                "commit": _commit(), "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        result = run_probe(device, ("4:1",) if args.small else tuple(LAYOUTS), args.probe_deadline_s,
                           out=args.out, meta=meta, peak_tbs=args.peak_tbs)
        print(json.dumps(result["probe"], indent=2, default=str))
        return result
    plan = SMALL_PLAN if args.small else FULL
    # One thread on a shared CPU: several spin-wait on cores other processes hold, passes slow down many-fold.
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    torch.set_float32_matmul_precision("highest")  # fp32 parity means fp32 matmuls, not TF32
    transformers.logging.set_verbosity_error()
    runner = RunnerOptions.resolve({"attention_backend": args.attention_backend,
                                    "cuda_graphs": args.cuda_graphs, "compile_backend": args.compile_backend})
    bandwidth = peak_bandwidth(device, args.peak_tbs)
    peak = bandwidth["tbs"] * 1e12
    meta = _meta(device, plan, args.small, bandwidth, runner)
    scale = args.budget_scale
    check = Check(args.out, meta, started + plan.deadline_s * scale, device)
    model, tokenizer = build_model(plan.shape, device)
    meta["setup_s"] = time.perf_counter() - started
    only = set(args.stages.split(","))
    plan = dataclasses.replace(plan, budgets_s={k: v * scale for k, v in plan.budgets_s.items()})
    run_stages(model, tokenizer, plan, check, runner, peak, args.tbt_slo_ms, only, PERF_DTYPE[device.type])
    meta["runner"] = runner.record()  # with what the runner reported once built
    meta["total_s"] = time.perf_counter() - started
    check.result["table"] = text = table(check.result)
    check.save()
    print(text)
    return check.result


if __name__ == "__main__":
    main()
