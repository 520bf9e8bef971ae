"""Token sampling (greedy / temperature / top-k / top-p / per-request seed) and stop checks."""

from __future__ import annotations

import torch

from replicas.request import Request, SamplingParams


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of `logits` (N, V) for the matching request."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out = list(greedy)
    for i, req in enumerate(requests):
        if not req.params.greedy:
            out[i] = _sample_one(logits[i], req.params, req.generator)
    return out


def _sample_one(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits (V,) -> one token id, reproducible when the request carries a seeded generator."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = sorted_probs.cumsum(0)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=gen)
        return int(idx[choice])
    return int(torch.multinomial(probs, 1, generator=gen))


def stop_token_hit(token_id: int, params: SamplingParams, eos_token_ids: frozenset[int]) -> bool:
    if token_id in params.stop_token_ids:
        return True
    return not params.ignore_eos and token_id in eos_token_ids


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `search_from`; (index, stop) or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
