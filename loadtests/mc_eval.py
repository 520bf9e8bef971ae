"""Multiple-choice accuracy as lm-evaluation-harness scores it, through the HTTP API and with HF.

    python -m loadtests.mc_eval --url http://127.0.0.1:8000 [--model embedded:smollm2]

lm-eval's `local-completions` model scores each option of an item by one `/v1/completions`
request: the context's and the continuation's token ids as the prompt, `echo: true`,
`logprobs: 1`, `max_tokens: 0`, `temperature: 0`; the option's score is the sum of the
continuation tokens' logprobs (`token_logprobs[ctxlen:]`), and the highest score is the pick.
`score_hf` computes the same sums from HF's own forward, so the two sets of picks can be
compared item by item. The items are `loadtests/real_text.MULTIPLE_CHOICE`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from loadtests.real_text import MULTIPLE_CHOICE, Choice, mc_accuracy, mc_picks, mc_requests

BATCH = 8  # prompts per request, as lm-eval's batch_size


def encode_pairs(tokenizer: Any, items: Sequence[Choice]) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) per option, tokenized apart as lm-eval does."""
    return [(tokenizer.encode(ctx, add_special_tokens=False), tokenizer.encode(cont, add_special_tokens=False))
            for _, ctx, cont in mc_requests(items)]


def score_http(base_url: str, model: str, pairs: Sequence[tuple[list[int], list[int]]],
               timeout_s: float = 300.0) -> list[float]:
    """Each option's summed continuation logprob, through `/v1/completions` as lm-eval sends it."""
    import httpx

    scores: list[float] = []
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for start in range(0, len(pairs), BATCH):
            chunk = pairs[start:start + BATCH]
            body = {"model": model, "prompt": [ctx + cont for ctx, cont in chunk], "echo": True,
                    "logprobs": 1, "max_tokens": 0, "temperature": 0}
            resp = client.post("/v1/completions", json=body)
            resp.raise_for_status()
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            for (ctx, cont), choice in zip(chunk, choices):
                scores.append(sum(choice["logprobs"]["token_logprobs"][len(ctx):len(ctx) + len(cont)]))
    return scores


def score_hf(model: Any, pairs: Sequence[tuple[list[int], list[int]]]) -> list[float]:
    """The same sums from HF's own forward over each context + continuation."""
    import torch

    scores = []
    with torch.inference_mode():
        for ctx, cont in pairs:
            ids = ctx + cont
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            # Token i is predicted by the row before it.
            scores.append(sum(logprobs[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))))
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="embedded:smollm2", help="the served model (its tokenizer is loaded here)")
    p.add_argument("--served-name", help="the name clients send (default: the model with ':' made '-')")
    p.add_argument("--hf", action="store_true", help="also score with HF in this process and compare")
    args = p.parse_args()
    from replicas.model_files import load_tokenizer

    pairs = encode_pairs(load_tokenizer(args.model), MULTIPLE_CHOICE)
    served = args.served_name or args.model.replace(":", "-")
    http_picks = mc_picks(MULTIPLE_CHOICE, score_http(args.url, served, pairs))
    print(f"through the server: {mc_accuracy(MULTIPLE_CHOICE, http_picks):.0%} of {len(MULTIPLE_CHOICE)} items")
    if args.hf:
        from replicas.models import load_model

        hf_picks = mc_picks(MULTIPLE_CHOICE, score_hf(load_model(args.model)[0], pairs))
        same = sum(a == b for a, b in zip(http_picks, hf_picks))
        print(f"with HF:            {mc_accuracy(MULTIPLE_CHOICE, hf_picks):.0%}; same pick on {same}/{len(hf_picks)}")


if __name__ == "__main__":
    main()
