"""Token sampling (greedy / temperature / top-k / top-p / per-request seed) and stop checks.

All rows that sample are handled together. Rows that keep the whole distribution (no top-k, no
top-p) draw by its CDF: one cumulative sum and one uniform per row, no noise over the vocabulary.
The others: one temperature division, one partial top-k over the batch (at least the
TOP_P_CANDIDATES most likely tokens for top-p rows; a row whose nucleus is wider sorts its own
vocabulary), one top-p cut, and one draw by the exponential race (argmax of p / E with E ~ Exp(1)
picks token i with probability p_i). A seeded request draws from its own generator, indexed by
token id, so its tokens are reproducible whatever else is in the batch.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from replicas.request import Request


def argmax(logits: torch.Tensor) -> list[int]:
    """The most likely token of each row of `logits` (N, V): greedy rows' pick."""
    return _argmax(logits).tolist()


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of `logits` (N, V) for the matching request."""
    out = _argmax(logits)
    rows = [i for i, req in enumerate(requests) if not req.params.greedy]
    if rows:
        picked = _sample_rows(logits[rows].float(), [requests[i] for i in rows])
        out[rows] = picked.cpu().numpy()
    return out.tolist()


def token_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> None:
    """For the rows whose request asks for logprobs: the chosen token's log-probability and the
    top alternatives', from log_softmax of the raw logits, all such rows in one call; appended to
    each request's `output_logprobs`."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return
    scored = _scored(logits[rows], [tokens[i] for i in rows], [requests[i].params.logprobs for i in rows])
    for i, entry in zip(rows, scored):
        requests[i].output_logprobs.append(entry)


def prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Request, int]]) -> None:
    """Score prompt tokens from the logits (M, V) of the positions before them (the model
    runner's `PassLogits.prompt`, `spans` its (request, rows)), all rows in one call; appended to
    each request's `prompt_logprobs` (raw, like `token_logprobs`)."""
    if not spans:
        return
    chosen: list[int] = []
    ks: list[int] = []
    for req, n in spans:
        done = len(req.prompt_logprobs)  # the first row scores prompt token done + 1
        chosen += req.prompt_token_ids[done + 1:done + 1 + n]
        ks += [req.params.prompt_logprobs] * n
    scored = iter(_scored(logits, chosen, ks))
    for req, n in spans:
        req.prompt_logprobs.extend(itertools.islice(scored, n))


def _scored(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row of logits (n, V): log_softmax's value at chosen[row] and its top ks[row] (id, value)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    picked = lp.gather(1, torch.tensor(chosen, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(ks)
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [(picked[j], tuple(zip(top_i[j][:n], top_v[j][:n]))) for j, n in enumerate(ks)]


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """Row-wise argmax as a numpy array. On CPU numpy's is an order of magnitude faster than
    torch's (256 x 2048 float32: 0.04 ms against 0.5 ms on one thread)."""
    if logits.device.type == "cpu":
        return logits.float().numpy().argmax(axis=-1)
    return logits.argmax(dim=-1).cpu().numpy()


# Rows without top_k first look for their top-p nucleus among this many most likely tokens (one
# partial top-k over the batch); only a row whose candidates hold less than its top_p of the
# probability sorts its whole vocabulary.
TOP_P_CANDIDATES = 256


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits (n, V) of non-greedy requests -> (n,) token ids."""
    n, vocab = logits.shape
    params = [r.params for r in requests]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    logits = logits / temps
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    plain = [k == vocab and p >= 1.0 for k, p in zip(ks, ps)]  # the whole distribution
    noise = _seeded_noise(requests, plain, vocab, logits.dtype, logits.device)
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    rows = [i for i in range(n) if plain[i]]
    if rows:  # by its CDF: one uniform a row, no noise over the vocabulary
        out[rows] = _by_cdf(torch.softmax(_take(logits, rows), dim=-1), [requests[i] for i in rows],
                            [noise[i] for i in rows])
    rows = [i for i in range(n) if not plain[i]]
    if not rows:
        return out
    sub, ks_t = _take(logits, rows), torch.tensor([ks[i] for i in rows], device=logits.device)
    has_k = ks_t < vocab
    top_ks = [ks[i] for i in rows if ks[i] < vocab]
    cand = max(top_ks) if len(top_ks) == len(rows) else min(vocab, max(top_ks + [TOP_P_CANDIDATES]))
    values, index = torch.topk(sub, cand, dim=-1)  # sorted, descending
    values = values.masked_fill(torch.arange(cand, device=logits.device)[None, :] >= ks_t[:, None],
                                float("-inf"))
    # A top-k row's distribution is renormalised over its k; a top-p-only row's is the vocabulary's.
    norm = torch.logsumexp(values, -1, keepdim=True)
    if not bool(has_k.all()):
        norm = torch.where(has_k[:, None], norm, torch.logsumexp(sub, -1, keepdim=True))
    probs = torch.exp(values - norm)  # (rows, cand)
    p_t = torch.tensor([ps[i] for i in rows], dtype=probs.dtype, device=probs.device)
    probs, cum = _top_p(probs, p_t)
    reqs, rnoise = [requests[i] for i in rows], [noise[i] for i in rows]
    picked = _race(probs, reqs, rnoise, index)
    # The candidates hold a top-k row's answer, and a top-p row's once they reach its top_p;
    # a row whose nucleus is wider sorts its whole vocabulary.
    wide = [j for j, ok in enumerate((has_k | (cum[:, -1] >= p_t) | (cand == vocab)).tolist()) if not ok]
    if wide:
        sorted_v, sorted_i = torch.sort(sub[wide], dim=-1, descending=True)
        probs, _ = _top_p(torch.softmax(sorted_v, dim=-1), p_t[wide])
        picked[wide] = _race(probs, [reqs[j] for j in wide], [rnoise[j] for j in wide], sorted_i)
    out[rows] = picked
    return out


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`probs` (n, c), sorted descending, keeping each row's smallest prefix whose mass reaches
    its top_p (the first candidate always stays); and the cumulative mass before the cut."""
    cum = probs.cumsum(dim=-1)
    return probs.masked_fill((cum - probs) >= top_p[:, None], 0.0), cum


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without copying when the rows are all of them."""
    return x if len(rows) == x.shape[0] else x[rows]


def _seeded_noise(requests: list[Request], plain: list[bool], vocab: int, dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor | None]:
    """This step's randomness of each seeded request, from its own generator (on the CPU, where
    it lives): one uniform for a row sampled by its CDF (`plain`), else one E ~ Exp(1) per
    vocabulary entry in token order (the race, indexed by token id whichever candidates a path
    keeps); None for unseeded rows. A seeded request's tokens then depend on its seed alone,
    not on what else is in the batch."""
    out: list[torch.Tensor | None] = []
    for r, whole in zip(requests, plain):
        if r.params.seed is None:
            out.append(None)
            continue
        if r.generator is None:  # the first seeded draw of this request
            r.generator = torch.Generator().manual_seed(r.params.seed)
        if whole:
            out.append(torch.rand(1, dtype=dtype, generator=r.generator, device="cpu").to(device))
        else:
            out.append(torch.empty(vocab, dtype=dtype, device="cpu").exponential_(generator=r.generator).to(device))
    return out


def _by_cdf(probs: torch.Tensor, requests: list[Request], noise: list[torch.Tensor | None]) -> torch.Tensor:
    """One draw per row of `probs` (n, V): the first token whose cumulative probability passes a
    uniform u (seeded rows: their own u from `noise`)."""
    u = torch.rand(len(requests), dtype=probs.dtype, device=probs.device)
    for j, own in enumerate(noise):
        if own is not None:
            u[j] = own[0]
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _race(probs: torch.Tensor, requests: list[Request], noise: list[torch.Tensor | None],
          index: torch.Tensor) -> torch.Tensor:
    """One token per row from (unnormalised) `probs` (n, c): the one at the argmax of p / E,
    E ~ Exp(1). `index`: the token id of each column (candidates, sorted); `noise`: a seeded
    row's E per token id (`_seeded_noise`), fresh draws for the rest."""
    e = torch.empty_like(probs)
    if any(x is None for x in noise):
        e.exponential_()
    for j, full in enumerate(noise):
        if full is not None:
            e[j] = full[index[j]]
    choice = (probs / e.clamp_min_(1e-30)).argmax(dim=-1, keepdim=True)
    return index.gather(1, choice).squeeze(1)


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `search_from`; (index, stop) or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
