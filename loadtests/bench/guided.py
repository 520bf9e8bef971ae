"""What structured output costs: output tok/s with 0%, 50% and 100% of requests under a JSON schema.

    python -m loadtests.bench.guided [--model embedded:mid] [--repeats 3] [--json PATH]
    python -m loadtests.bench.guided --quick        # embedded:tiny, one repeat: a smoke run

The quick `chat` workload of `bench.engine` (mixed heavy-tailed lengths, all at t=0, greedy)
under stall_free, the same requests in every run; only `SamplingParams.guided` differs. The
schema is an array of order records (enums, integer ranges, a bounded string, a decimal, a
nested array) with more items than any request has tokens, so a constrained request never
completes its grammar early: it generates exactly as many tokens as its plain twin (checked),
and the difference is the cost of masking (the bitmask fill, applying it, advancing the
matcher). "mask time" is the bitmask fill's share of the wall time. Runs are interleaved over
repeats and medians reported (read the ratios).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from loadtests.bench.engine import kv_capacity, run_engine, summarize
from loadtests.bench.logprobs import SHARES, run_shares  # noqa: F401 - SHARES re-exported (its test reads it here)
from loadtests.harness.report import OMIT, bench_parser, report
from replicas import Engine, EngineConfig, SamplingParams
from replicas.protocol import GuidedDecoding

TARGET = 0.85  # the target: masking costs under 15% of output tok/s
ORDER = {"type": "object", "additionalProperties": False,
         "required": ["sku", "qty", "status", "price", "tags"],
         "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 500},
                        "status": {"enum": ["new", "paid", "shipped", "returned"]},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.01},
                        "note": {"type": "string", "maxLength": 24},
                        "tags": {"type": "array", "items": {"enum": ["gift", "bulk", "fragile"]},
                                 "maxItems": 3}}}
SCHEMA = {"type": "array", "minItems": 1000, "items": ORDER}  # never complete within max_tokens


def run(model_tok, workload, share: float, block_size: int = 16) -> dict:
    engine = Engine(*model_tok, EngineConfig(policy="stall_free", max_batch_prefill_tokens=512,
                                             max_batch_total_tokens=kv_capacity(workload, block_size),
                                             block_size=block_size, max_num_seqs=64))
    engine.generate([[5, 6, 7, 8] * 4] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    engine.grammars.matcher(guided)  # compiled once up front, as a cached schema would be
    every = round(1 / share) if share else 0
    asks = {r.request_id for i, r in enumerate(workload.requests) if every and i % every == 0}
    original, fill = engine.add_request, engine.grammars.bitmask
    added, mask_s = [], [0.0]

    def add(prompt, params, **kw):  # the same request, under the schema for the chosen share
        if kw.get("request_id") in asks:
            params = dataclasses.replace(params, guided=guided)
        req = original(prompt, params, **kw)
        added.append(req)
        return req

    def timed_fill(requests):  # the host's share of masking: filling the pass's bitmask
        t = time.perf_counter()
        out = fill(requests)
        mask_s[0] += time.perf_counter() - t
        return out

    engine.add_request, engine.grammars.bitmask = add, timed_fill
    wall = time.perf_counter()
    stats = summarize(run_engine(engine, workload, f"guided {share:.0%}"))
    wall = time.perf_counter() - wall
    for req in added:  # a constrained request must have done its plain twin's work
        assert len(req.output_token_ids) == req.params.max_tokens, (req.request_id, req.finish_reason)
        assert req.guide is None or not req.guide.is_error(), req.guide.get_error()
    return {"output_tok_s": stats["output_tok_s"], "mask_share": mask_s[0] / wall,
            "constrained": len(asks)}


def main(argv: list[str] | None = None) -> dict:
    args = bench_parser("loadtests.bench.guided", __doc__, model=None, seed=OMIT, threads=2, repeats=None,
                        model_help="default embedded:mid (embedded:tiny with --quick)",
                        repeats_help="default 3 (1 with --quick)",
                        quick="a smoke run: embedded:tiny, one repeat").parse_args(argv)
    args.model = args.model or ("embedded:tiny" if args.quick else "embedded:mid")
    args.repeats = args.repeats or (1 if args.quick else 3)
    workload, runs = run_shares(args, run)
    base = statistics.median(r["output_tok_s"] for r in runs[0.0])
    rows = []
    for share, rs in runs.items():
        tok_s = statistics.median(r["output_tok_s"] for r in rs)
        rows.append({"share": share, "constrained": rs[0]["constrained"], "output_tok_s": tok_s,
                     "vs_plain": tok_s / base, "mask_share": statistics.median(r["mask_share"] for r in rs),
                     "repeats": [r["output_tok_s"] for r in rs]})
    worst = min(r["vs_plain"] for r in rows)
    text = "\n".join(
        [f"Structured output cost: {args.model}, stall_free, quick chat ({len(workload)} requests, greedy), "
         f"{args.threads} threads, medians of {args.repeats}",
         f"{'share guided':>13}{'requests':>10}{'out tok/s':>11}{'vs plain':>10}{'mask time':>11}"]
        + [f"{r['share']:>13.0%}{r['constrained']:>10}{r['output_tok_s']:>11.1f}{r['vs_plain']:>10.3f}"
           f"{r['mask_share']:>10.1%}" for r in rows]
        + [f"target: >= {TARGET:.2f} (masking costs under 15%): {'met' if worst >= TARGET else 'MISSED'} "
           f"(worst {worst:.3f})"])
    return report(text, {"config": vars(args), "schema": SCHEMA, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
