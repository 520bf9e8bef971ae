"""The batched sampler alone: milliseconds per call for 128 rows at two vocabulary sizes.

    python -m loadtests.bench.sampler [--rows 128] [--threads 1]

Random logits (N(0, 4)), temperature 0.8, three parameter sets: top_p only, top_k + top_p, plain
temperature. Means over `--reps` calls on fresh logits (fresh data: repeating one tensor makes
partial sorts look several times faster than they are).
"""

from __future__ import annotations

import time

import torch

from loadtests.harness.report import OMIT, bench_parser, report
from replicas.protocol import SamplingParams
from replicas.request import Request
from replicas.execution.sampler import _sample_rows

CASES = (("top_p 0.9", {"temperature": 0.8, "top_p": 0.9}),
         ("top_k 50 + top_p 0.9", {"temperature": 0.8, "top_p": 0.9, "top_k": 50}),
         ("temperature", {"temperature": 0.8}))


def time_case(params: dict, vocab: int, rows: int, reps: int) -> float:
    reqs = [Request(str(i), [1], SamplingParams(max_tokens=4, **params)) for i in range(rows)]
    xs = [torch.randn(rows, vocab) * 4 for _ in range(reps + 1)]
    _sample_rows(xs[0], reqs)  # warm-up
    start = time.perf_counter()
    for x in xs[1:]:
        _sample_rows(x, reqs)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("loadtests.bench.sampler", __doc__, model=OMIT, seed=OMIT, threads=1)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--vocabs", default="2048,32000")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [{"vocab": vocab, "case": name, "ms": time_case(params, vocab, args.rows, args.reps)}
            for vocab in (int(v) for v in args.vocabs.split(",")) for name, params in CASES]
    lines = [f"{args.rows} rows, {args.threads} torch thread(s), ms per call"]
    lines += [f"V={r['vocab']:>6} {r['case']:<22} {r['ms']:8.2f}" for r in rows]
    return report("\n".join(lines), {"config": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
