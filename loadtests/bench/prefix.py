"""What the prefix cache buys: the same workloads with `enable_prefix_caching` on and off.

    python -m loadtests.bench.prefix [--model embedded:mid] [--repeats 3] [--json PATH] [--quick]

- shared_system_prompt: 48 requests at t=0, each a 1024-token system prompt (the same for all)
  plus a 20-80-token user turn, 32 tokens out (`workloads.shared_prefix_workload`);
- multi_turn: 8 conversations of 4 turns driven closed-loop: a turn is sent when the previous
  one has answered, its prompt the whole history (system prompt, earlier messages, the answers
  the engine gave) plus a new message (`workloads.multi_turn_conversations`).

stall_free, MBP 512, greedy with ignore_eos (the same tokens either way); on and off alternate
over repeats and medians are reported (a noisy shared machine: read the ratios). Per run: output
tok/s (tokens / first arrival to last token), TTFT p50/p99, the prompt tokens the model ran, and
the cache's hit rate (cached / looked-up prompt tokens).
"""

from __future__ import annotations

import statistics
import time

from loadtests.bench.engine import Trace, run_engine, summarize
from loadtests.harness.report import bench_parser, load_bench_model, report
from loadtests.harness.workloads import Conversation, multi_turn_conversations, shared_prefix_workload
from replicas import Engine, EngineConfig, SamplingParams

KV_TOKENS = 16_384


def make_engine(model_tok, caching: bool) -> Engine:
    engine = Engine(*model_tok, EngineConfig(policy="stall_free", max_batch_prefill_tokens=512,
                                             max_batch_total_tokens=KV_TOKENS, block_size=16,
                                             max_num_seqs=64, enable_prefix_caching=caching))
    engine.generate([[5, 6, 7, 8] * 4] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.iterations.clear()
    return engine


def run_conversations(engine: Engine, conversations: list[Conversation]) -> list[Trace]:
    """Each conversation's turns in order, the next sent as soon as the previous one finished."""
    answers: dict[str, list[list[int]]] = {c.conversation_id: [] for c in conversations}
    live: dict[str, tuple[Conversation, int, object]] = {}
    traces: list[Trace] = []

    def send(conv: Conversation, turn: int) -> None:
        max_tokens = conv.turns[turn][1]
        req = engine.add_request(conv.prompt(turn, answers[conv.conversation_id]),
                                 SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                 request_id=f"{conv.conversation_id}-t{turn}", arrival_time=time.perf_counter())
        live[req.request_id] = (conv, turn, req)

    for conv in conversations:
        send(conv, 0)
    while live:
        for out in engine.step():
            if not out.finished or out.request_id not in live:
                continue
            conv, turn, req = live.pop(out.request_id)
            answers[conv.conversation_id].append(list(req.output_token_ids))
            traces.append(Trace(req.request_id, f"turn{turn}", req.arrival_time, list(req.token_times)))
            if turn + 1 < len(conv.turns):
                send(conv, turn + 1)
    return traces


def measure(model_tok, name: str, work, caching: bool) -> dict:
    engine = make_engine(model_tok, caching)
    label = f"{name} cache {'on' if caching else 'off'}"
    traces = run_engine(engine, work, label) if name == "shared_system_prompt" else run_conversations(engine, work)
    row = summarize(traces)
    row["prompt_tokens_run"] = sum(it.num_prefill_tokens for it in engine.iterations)
    row["hit_rate"] = engine.blocks.hit_rate
    return row


def main(argv: list[str] | None = None) -> dict:
    args = bench_parser("loadtests.bench.prefix", __doc__, quick="small workloads (a smoke run)",
                        threads=2, repeats=3).parse_args(argv)
    model_tok = load_bench_model(args)
    vocab = model_tok[0].get_output_embeddings().weight.shape[0]
    avoid = list(model_tok[1].all_special_ids)
    n, convs = (8, 2) if args.quick else (48, 8)
    workloads = {"shared_system_prompt": shared_prefix_workload(vocab, args.seed, num_requests=n, avoid_ids=avoid),
                 "multi_turn": multi_turn_conversations(vocab, args.seed, num_conversations=convs,
                                                        avoid_ids=avoid)}
    runs: dict[tuple[str, bool], list[dict]] = {(w, c): [] for w in workloads for c in (False, True)}
    for rep in range(args.repeats):
        for name, work in workloads.items():
            for caching in ((False, True) if rep % 2 == 0 else (True, False)):
                runs[name, caching].append(measure(model_tok, name, work, caching))
    keys = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p99_s", "prompt_tokens_run", "hit_rate")
    rows = []
    for (name, caching), reps in runs.items():
        rows.append({"workload": name, "cache": caching,
                     **{k: statistics.median(r[k] for r in reps) for k in keys}, "repeats": reps})
    lines = [f"prefix cache on vs off: {args.model}, stall_free MBP 512, {args.threads} threads, "
             f"medians of {args.repeats}",
             f"{'workload':<22}{'cache':>6}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'TBT p99':>9}{'prompt run':>11}{'hit rate':>9}"]
    for r in rows:
        lines.append(f"{r['workload']:<22}{'on' if r['cache'] else 'off':>6}{r['output_tok_s']:>11.1f}"
                     f"{r['ttft_p50_s'] * 1000:>8.0f}ms{r['ttft_p99_s'] * 1000:>8.0f}ms"
                     f"{r['tbt_p99_s'] * 1000:>7.0f}ms{r['prompt_tokens_run']:>11.0f}{r['hit_rate']:>9.1%}")
    by = {(r["workload"], r["cache"]): r for r in rows}
    for name in workloads:
        on, off = by[name, True], by[name, False]
        lines.append(f"{name}: on/off output tok/s {on['output_tok_s'] / off['output_tok_s']:.2f}x, "
                     f"TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x lower")
    lines.append("targets (shared_system_prompt): TTFT p50 >= 3x lower, output tok/s >= 1.5x")
    return report("\n".join(lines), {"config": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
