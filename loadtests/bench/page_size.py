"""What a larger KV page costs the prefix cache, and what it buys the flex kernels.

    python -m loadtests.bench.page_size [--sizes 16 32 64 128] [--json PATH]

The prefix cache shares whole pages only (a prompt's hit is its longest run of full pages seen
before, at most all its tokens but the last), so a larger page leaves more of each shared prefix
uncached. Counted without a model, by the cache's own hashes (`prefix_hash.block_hashes`), with
nothing evicted, on the prefix benchmark's workloads (`loadtests.bench.prefix`): 48 prompts
sharing a 1,024-token system prompt, and 8 conversations of 4 turns (each turn's prompt the whole
history, 48-token answers). Beside it, the flex kernels' side: the KV tiles one decode row visits
at 1k context (a page is one KV tile, `attention_flex`), and the slots a sequence wastes in its
last page on average.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from loadtests.harness.report import write_json
from loadtests.harness.workloads import multi_turn_conversations, random_prompt, shared_prefix_workload
from replicas.scheduling.prefix_hash import block_hashes

VOCAB = 2048
CONTEXT = 1024  # the decode row of the device check's MBU stage


def cached_tokens(prompts: Sequence[Sequence[int]], page: int) -> tuple[int, int]:
    """(tokens found in the cache, tokens looked up) over `prompts` in order."""
    seen: set[int] = set()
    hit = total = 0
    for p in prompts:
        hashes = block_hashes(p, page)
        run = 0
        while run < len(hashes) and hashes[run] in seen:
            run += 1
        hit += min(run * page, len(p) - 1)
        total += len(p)
        seen.update(hashes)
    return hit, total


def conversation_prompts(seed: int = 0) -> list[list[int]]:
    """Each turn's prompt: system + earlier turns and answers + the new message (answers drawn
    at random, as a model's would be: what matters is that the history repeats)."""
    rng = np.random.default_rng(seed + 1)
    prompts = []
    for conv in multi_turn_conversations(VOCAB, seed):
        history = list(conv.system)
        for message, output in conv.turns:
            history += list(message)
            prompts.append(list(history))
            history += random_prompt(rng, output, VOCAB, ())
    return prompts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.page_size", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workloads = {"shared_system_prompt": [r.prompt_token_ids for r in shared_prefix_workload(VOCAB).requests],
                 "multi_turn": conversation_prompts()}
    rows = []
    print(f"{'page':>5}{'tiles/row @1k':>15}{'waste/seq':>11}" + "".join(f"{w + ' hit':>26}" for w in workloads))
    for page in args.sizes:
        row = {"page": page, "tiles_per_decode_row": -(-CONTEXT // page), "mean_last_page_waste": (page - 1) / 2}
        for name, prompts in workloads.items():
            hit, total = cached_tokens(prompts, page)
            row[name] = {"cached": hit, "looked_up": total, "hit_rate": hit / total}
        rows.append(row)
        print(f"{page:>5}{row['tiles_per_decode_row']:>15}{row['mean_last_page_waste']:>11.1f}"
              + "".join(f"{row[w]['hit_rate']:>26.3f}" for w in workloads))
    result = {"context": CONTEXT, "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
