"""A small multiple-choice set, scored as lm-evaluation-harness scores it: through the HTTP API
(`score_http`) and with HF's own forward (`score_hf`), so the two sets of picks compare item by item.

lm-eval's `local-completions` model scores each option of an item by one `/v1/completions`
request: the context's and the continuation's token ids as the prompt, `echo: true`,
`logprobs: 1`, `max_tokens: 0`, `temperature: 0`; the option's score is the sum of the
continuation tokens' logprobs (`token_logprobs[ctxlen:]`), and the highest score is the pick.
Written for this repository (no dataset is downloaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BATCH = 8  # prompts per request, as lm-eval's batch_size


@dataclass(frozen=True)
class Choice:
    """A multiple-choice item scored as lm-eval scores it: the sum of the continuation's token
    logprobs after the context, for each option; the highest wins."""

    context: str
    options: tuple[str, ...]
    answer: int  # index into options


def _rotated(items: Sequence[Choice]) -> tuple[Choice, ...]:
    # Written with the answer first; item i's options are rotated by i so the answers spread
    # over every position (a scorer that prefers one position gains nothing).
    out = []
    for i, item in enumerate(items):
        k = i % len(item.options)
        opts = item.options[k:] + item.options[:k]
        out.append(Choice(item.context, opts, (item.answer - k) % len(opts)))
    return tuple(out)


MULTIPLE_CHOICE: tuple[Choice, ...] = _rotated((
    Choice("The capital of France is", (" Paris", " Berlin", " Madrid", " Rome"), 0),
    Choice("Water freezes at a temperature of", (" 0 degrees Celsius", " 50 degrees Celsius",
                                                  " 100 degrees Celsius", " 200 degrees Celsius"), 0),
    Choice("The largest ocean on Earth is the", (" Pacific Ocean", " Arctic Ocean", " Indian Ocean",
                                                 " Southern Ocean"), 0),
    Choice("A week has", (" seven days", " three days", " ten days", " twelve days"), 0),
    Choice("The sun rises in the", (" east", " west", " north", " south"), 0),
    Choice("Bees make", (" honey", " milk", " silk", " glass"), 0),
    Choice("The opposite of hot is", (" cold", " warm", " loud", " tall"), 0),
    Choice("Two plus two equals", (" four", " five", " three", " seven"), 0),
    Choice("The planet closest to the Sun is", (" Mercury", " Jupiter", " Neptune", " Saturn"), 0),
    Choice("To see in the dark you can switch on a", (" lamp", " spoon", " pillow", " carpet"), 0),
    Choice("Shakespeare was a famous English", (" playwright", " footballer", " astronaut",
                                                " chemist"), 0),
    Choice("Ice cream is usually served", (" cold", " boiling", " frozen solid in a fire",
                                           " as a soup"), 0),
    Choice("A baby cat is called a", (" kitten", " puppy", " calf", " foal"), 0),
    Choice("The chemical symbol for gold is", (" Au", " Ag", " Fe", " Pb"), 0),
    Choice("People use an umbrella when it", (" rains", " sleeps", " sings", " reads"), 0),
    Choice("The first month of the year is", (" January", " March", " July", " October"), 0),
    Choice("A triangle has", (" three sides", " four sides", " five sides", " six sides"), 0),
    Choice("Plants need sunlight to", (" grow", " sing", " fly", " melt"), 0),
    Choice("The Great Wall is in", (" China", " Brazil", " Canada", " Egypt"), 0),
    Choice("You write on paper with a", (" pen", " fork", " shoe", " brick"), 0),
))


def mc_requests(items: Sequence[Choice] = MULTIPLE_CHOICE) -> list[tuple[int, str, str]]:
    """(item index, context, continuation) for every option of every item, in order."""
    return [(i, item.context, opt) for i, item in enumerate(items) for opt in item.options]


def mc_picks(items: Sequence[Choice], scores: Sequence[float]) -> list[int]:
    """The option each item picks given one score per `mc_requests` row (highest wins, the
    first of equals)."""
    picks, k = [], 0
    for item in items:
        row = list(scores[k:k + len(item.options)])
        picks.append(row.index(max(row)))
        k += len(item.options)
    return picks


def mc_accuracy(items: Sequence[Choice], picks: Sequence[int]) -> float:
    return sum(p == item.answer for item, p in zip(items, picks)) / len(items)


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
