"""Token sampling (greedy / temperature / top-k / top-p / per-request seed).

All rows that sample are handled together. Rows that keep the whole distribution (no top-k, no
top-p) draw by its CDF: one cumulative sum and one uniform per row, no noise over the vocabulary.
The others: one temperature division, one partial top-k over the batch (at least the
TOP_P_CANDIDATES most likely tokens for top-p rows; a row whose nucleus is wider sorts its own
vocabulary), one top-p cut, and one draw by the exponential race (argmax of p / E with E ~ Exp(1)
picks token i with probability p_i). A seeded request's randomness is a hash of its seed, its draw
count and the token id, computed on the device only where a path needs it (a uniform for a CDF
row, the candidates' E for a race): its tokens are reproducible whatever else is in the batch and
whichever path its row takes, and no noise over the vocabulary is made on the host or uploaded.

A pass's sampling is planned on the host before the forward pass (`plan`: every parameter's
arrays, seed keys and grammar bitmasks join the pass's one upload) and runs on the device
after it (`sample`), its tokens and logprobs coming back in one copy. The model runner does
both (`Sampler`, which it owns): its `run` hands the engine the pass's token ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from replicas.execution.guided import Grammars, apply_bitmask
from replicas.execution.logits_processors import LogitsProcessors, ProcessorsPlan
from replicas.request import Request
from replicas.execution.transfer import HostPack, Part, Staging, download

# Rows without top_k first look for their top-p nucleus among this many most likely tokens (one
# partial top-k over the batch); only a row whose candidates hold less than its top_p of the
# probability sorts its whole vocabulary.
TOP_P_CANDIDATES = 256
_ARGMAX_ONLY = attrgetter("argmax_only")  # a request's row takes the logits' argmax alone


def is_host(device: torch.device) -> bool:
    """Whether the pass's device is the host itself: reading its tensors there copies nothing and
    waits for nothing, so the sampler may check on the host and use numpy's kernels (an order of
    magnitude faster than torch's for a row-wise argmax on CPU)."""
    return device.type == "cpu"


def sorts_top_p(device: torch.device) -> bool:
    """Whether top-p-only rows sort their whole vocabulary every pass. On an accelerator: yes, a
    sort there is cheap and finding out which rows need one would cost a sync. On CPU: no, a
    full sort costs many times a partial top-k there, and the check costs nothing (no device to
    wait for)."""
    return not is_host(device)


@dataclass
class DrawPlan:
    """The non-greedy rows of a pass (their indices into the sampling rows, `rows`) and what
    they draw with."""

    rows: Part  # (n,)
    temps: Part  # (n,) float32
    plain: Part | None  # draw-row indices sampled by their CDF (no top-k, no top-p)
    plain_keys: tuple[Part, Part] | None  # (each CDF row's seed key, whether it is seeded)
    filtered: Part | None  # draw-row indices filtered by top-k / top-p
    ks: Part | None  # (f,) each filtered row's k (the vocabulary: none)
    ps: Part | None  # (f,) float32 top_p
    race_keys: tuple[Part, Part] | None  # (each filtered row's seed key, whether it is seeded)
    candidates: int
    all_top_k: bool
    any_unseeded: bool
    sort_rows: Part | None  # filtered rows sorting their whole vocabulary without a check
    num_plain: int
    num_filtered: int


@dataclass
class SamplingPlan:
    """A pass's sampling, planned on the host; its arrays travel in the pass's one upload."""

    requests: list[Request]
    prompt_spans: list[tuple[Request, int]]
    argmax_only: bool  # every row greedy, nothing else read
    processors: ProcessorsPlan | None = None
    guided: tuple[Part, Part, bool, bool] | None = None  # (rows, bitmask, keep raw, every row)
    draw: DrawPlan | None = None
    logprob_rows: Part | None = None
    logprob_requests: list[Request] | None = None
    logprob_ks: list[int] | None = None
    prompt_chosen: Part | None = None  # (M,) the prompt token each prompt row scores
    prompt_ks: list[int] | None = None


def plan(requests: list[Request], prompt_spans: list[tuple[Request, int]], pack: HostPack, *,
         device: torch.device, vocab: int, processors: LogitsProcessors | None = None,
         grammars: Grammars | None = None) -> SamplingPlan:
    """Host side of a pass's sampling: every parameter's arrays (processors, grammar bitmasks,
    temperatures, top-k/top-p, seed keys, logprob rows, prompt tokens scored) added to `pack`."""
    out = SamplingPlan(requests, prompt_spans, all(map(_ARGMAX_ONLY, requests)))
    if prompt_spans:
        chosen: list[int] = []
        ks: list[int] = []
        for req, n in prompt_spans:
            done = len(req.prompt_logprobs)  # the first row scores prompt token done + 1
            chosen += req.prompt_token_ids[done + 1:done + 1 + n]
            ks += [req.params.prompt_logprobs] * n
        out.prompt_chosen, out.prompt_ks = pack.add(chosen), ks
    if out.argmax_only:
        if processors is not None:
            processors.release_finished()
        return out
    if processors is not None:
        out.processors = processors.plan(requests, pack, device)
    if grammars is not None and (found := grammars.bitmask(requests)) is not None:
        keep_raw = any(r.params.logprobs is not None for r in requests)
        out.guided = (pack.add(found[0]), pack.add(found[1], np.int32), keep_raw, len(found[0]) == len(requests))
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if rows:
        out.logprob_rows = pack.add(rows)
        out.logprob_requests = [requests[i] for i in rows]
        out.logprob_ks = [r.params.logprobs for r in out.logprob_requests]
    drawn = [i for i, r in enumerate(requests) if not r.params.greedy]
    if drawn:
        out.draw = _plan_draw(drawn, [requests[i] for i in drawn], pack, device, vocab)
    return out


class Sampler:
    """One replica's sampling, as its model runner drives it each pass: `plan` while the pass's
    upload is prepared, `sample` once the forward pass has produced the logits. Holds what
    outlives a pass: the logits processors' count tables and the grammar matchers' bitmasks."""

    def __init__(self, device: torch.device, vocab: int, processors: LogitsProcessors | None = None,
                 grammars: Grammars | None = None) -> None:
        self.device, self.vocab = device, vocab
        self.processors, self.grammars = processors, grammars

    def plan(self, requests: list[Request], prompt_spans: list[tuple[Request, int]],
             pack: HostPack) -> SamplingPlan:
        """Host side: the sampling rows of `requests` (batch order) and the prompt rows scored."""
        return plan(requests, prompt_spans, pack, device=self.device, vocab=self.vocab,
                    processors=self.processors, grammars=self.grammars)

    def sample(self, sampled: torch.Tensor, prompt: torch.Tensor, p: SamplingPlan, pack: HostPack) -> list[int]:
        """Device side, then the pass's one copy back: the token of each sampling row."""
        return sample(sampled, prompt, p, pack, self.processors)

    def sample_on_device(self, sampled: torch.Tensor, prompt: torch.Tensor, p: SamplingPlan,
                         pack: HostPack) -> list[torch.Tensor]:
        """Device side alone: what the copy back carries, the tokens (N,) first (`read_back`)."""
        return sample_on_device(sampled, prompt, p, pack, self.processors)

    def read_back(self, host: list[np.ndarray], p: SamplingPlan) -> list[int]:
        """Host side, once the copy back arrived: the tokens (logprobs recorded)."""
        return read_back(host, p)


def _plan_draw(rows: list[int], requests: list[Request], pack: HostPack, device: torch.device,
               vocab: int) -> DrawPlan:
    params = [r.params for r in requests]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    plain = [k == vocab and p >= 1.0 for k, p in zip(ks, ps)]  # the whole distribution
    keys = _seed_keys(requests)
    prows = [i for i in range(len(rows)) if plain[i]]
    frows = [i for i in range(len(rows)) if not plain[i]]
    d = DrawPlan(pack.add(rows), pack.add([p.temperature for p in params], np.float32), None, None,
                 None, None, None, None, 0, True, False, None, len(prows), len(frows))
    if prows:
        d.plain = pack.add(prows)
        d.plain_keys = _keys_part([keys[i] for i in prows], pack)
    if frows:
        fks = [ks[i] for i in frows]
        top_ks = [k for k in fks if k < vocab]
        d.all_top_k = len(top_ks) == len(frows)
        d.candidates = max(top_ks) if d.all_top_k else min(vocab, max(top_ks + [TOP_P_CANDIDATES]))
        d.filtered, d.ks, d.ps = pack.add(frows), pack.add(fks), pack.add([ps[i] for i in frows], np.float32)
        d.race_keys = _keys_part([keys[i] for i in frows], pack)
        d.any_unseeded = any(keys[i] is None for i in frows)
        if sorts_top_p(device) and not d.all_top_k and d.candidates < vocab:
            d.sort_rows = pack.add([j for j, k in enumerate(fks) if k == vocab])
    return d


def _keys_part(keys: list[int | None], pack: HostPack) -> tuple[Part, Part] | None:
    """The rows' seed keys and which rows are seeded, in the upload; None when no row is."""
    if all(k is None for k in keys):
        return None
    return pack.add([0 if k is None else k for k in keys]), pack.add([k is not None for k in keys], np.bool_)


@torch.inference_mode()  # the forward pass's logits are inference tensors: edited in place
def sample(sampled: torch.Tensor, prompt: torch.Tensor, p: SamplingPlan, pack: HostPack,
           processors: LogitsProcessors | None = None) -> list[int]:
    """Device side of a pass's sampling, then its one copy back: the token of each sampling row
    (`sampled` (N, V)), each logprobs row's entry appended to its request's `output_logprobs`,
    the prompt rows' (`prompt` (M, V)) scores to their requests' `prompt_logprobs`. Logprobs are
    raw: from the model's logits, before the processors and the grammar."""
    return read_back(download(sample_on_device(sampled, prompt, p, pack, processors)), p)


@torch.inference_mode()
def sample_on_device(sampled: torch.Tensor, prompt: torch.Tensor, p: SamplingPlan, pack: HostPack,
                     processors: LogitsProcessors | None = None) -> list[torch.Tensor]:
    """The device side of `sample`: what the pass's copy back carries, the tokens (N,) first."""
    if p.argmax_only and not p.prompt_spans:
        return [_row_argmax(sampled)]
    x = sampled
    if processors is not None:
        x = processors.apply(x, p.processors, pack)
    if p.guided is not None:
        rows, bits, keep_raw, every = p.guided
        x = apply_bitmask(x, pack.get(rows), pack.get(bits), keep_raw, every)
    tokens = _greedy_picks(x, p)
    if p.draw is not None:
        d = p.draw
        rows = pack.get(d.rows)
        tokens.index_copy_(0, rows, _draw(x.index_select(0, rows).float(), d, pack))
    parts = [tokens]
    if p.logprob_rows is not None:
        rows = pack.get(p.logprob_rows)
        parts += _scored(sampled.index_select(0, rows), tokens.index_select(0, rows), max(p.logprob_ks))
    if p.prompt_chosen is not None:
        parts += _scored(prompt, pack.get(p.prompt_chosen), max(p.prompt_ks))
    return parts


def read_back(host: list[np.ndarray], p: SamplingPlan) -> list[int]:
    """The host side of `sample`, once the copy back arrived: the tokens, and the logprobs
    recorded on their requests."""
    token_ids = host[0].tolist()
    if p.logprob_rows is not None:
        for req, entry in zip(p.logprob_requests, _entries(host[1:4], p.logprob_ks)):
            req.output_logprobs.append(entry)
        host = host[:1] + host[4:]
    if p.prompt_chosen is not None:
        scored = iter(_entries(host[1:4], p.prompt_ks))
        for req, n in p.prompt_spans:
            req.prompt_logprobs.extend(itertools.islice(scored, n))
    return token_ids


def sample_logits(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of `logits` (N, V) for the matching request (a pass of its own)."""
    pack = HostPack()
    p = plan(requests, [], pack, device=logits.device, vocab=logits.shape[1])
    pack.send(logits.device, Staging(logits.device))
    return sample(logits, logits[:0], p, pack)


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits (n, V) of non-greedy requests -> (n,) token ids: the draw alone, with its own
    upload (what `loadtests.bench.sampler` times)."""
    pack = HostPack()
    d = _plan_draw(list(range(len(requests))), requests, pack, logits.device, logits.shape[1])
    pack.send(logits.device, Staging(logits.device))
    return _draw(logits.float(), d, pack)


def _greedy_picks(x: torch.Tensor, p: SamplingPlan) -> torch.Tensor:
    """(N,) each row's argmax, the greedy rows' pick (the drawn rows' are overwritten); nothing
    when every row draws."""
    if p.draw is not None and p.draw.num_plain + p.draw.num_filtered == x.shape[0]:
        return torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    return _row_argmax(x)


def _row_argmax(x: torch.Tensor) -> torch.Tensor:
    """(N,) each row's argmax, on x's device (on the host: numpy's)."""
    if is_host(x.device):
        return torch.from_numpy(x.float().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _scored(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Per row of logits (n, V): log_softmax's value at chosen[row], and its top k values and ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    picked = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [picked, top_v, top_i]


def _entries(host: list[np.ndarray], ks: list[int]) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """(value, top ks[row] (id, value)) per row, from `_scored`'s arrays copied back."""
    picked, k = host[0].tolist(), max(ks)
    top_v, top_i = host[1].reshape(len(ks), k).tolist(), host[2].reshape(len(ks), k).tolist()
    return [(picked[j], tuple(zip(top_i[j][:n], top_v[j][:n]))) for j, n in enumerate(ks)]


def _draw(logits: torch.Tensor, d: DrawPlan, pack: HostPack) -> torch.Tensor:
    """logits (n, V) of the non-greedy rows -> (n,) token ids."""
    n, vocab = logits.shape
    logits = logits / pack.get(d.temps).unsqueeze(1)
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if d.num_plain:  # by its CDF: one uniform a row, no noise over the vocabulary
        rows = pack.get(d.plain)
        probs = torch.softmax(logits if d.num_plain == n else logits.index_select(0, rows), dim=-1)
        out.index_copy_(0, rows, _by_cdf(probs, d, pack))
    if not d.num_filtered:
        return out
    rows = pack.get(d.filtered)
    sub = logits if d.num_filtered == n else logits.index_select(0, rows)
    ks_t, p_t = pack.get(d.ks), pack.get(d.ps)
    has_k = ks_t < vocab
    cand = d.candidates
    values, index = torch.topk(sub, cand, dim=-1)  # sorted, descending
    values = values.masked_fill(torch.arange(cand, device=logits.device)[None, :] >= ks_t[:, None],
                                float("-inf"))
    # A top-k row's distribution is renormalised over its k; a top-p-only row's is the vocabulary's.
    norm = torch.logsumexp(values, -1, keepdim=True)
    if not d.all_top_k:
        norm = torch.where(has_k[:, None], norm, torch.logsumexp(sub, -1, keepdim=True))
    probs, cum = _top_p(torch.exp(values - norm), p_t)  # (f, cand)
    e = _exponentials(probs.shape, index, d, pack)
    picked = _race(probs, e, index)
    # The candidates hold a top-k row's answer, and a top-p row's once they reach its top_p; a
    # row whose nucleus is wider sorts its whole vocabulary (on a device every top-p-only row
    # does, so no pass waits to find out which).
    if d.sort_rows is not None:
        wide = pack.get(d.sort_rows)
    elif d.all_top_k or cand == vocab:
        wide = None
    else:  # on CPU: a check that costs nothing there
        ok = (has_k | (cum[:, -1] >= p_t)).numpy()
        wide = torch.from_numpy(np.nonzero(~ok)[0]) if not ok.all() else None
    if wide is not None:
        sorted_v, sorted_i = torch.sort(sub.index_select(0, wide), dim=-1, descending=True)
        wprobs, _ = _top_p(torch.softmax(sorted_v, dim=-1), p_t.index_select(0, wide))
        we = _exponentials(wprobs.shape, sorted_i, d, pack, wide)
        wpick = _race(wprobs, we, sorted_i)
        if d.sort_rows is not None:  # keep the candidates' answer where they held the nucleus
            held = (has_k | (cum[:, -1] >= p_t)).index_select(0, wide)
            wpick = torch.where(held, picked.index_select(0, wide), wpick)
        picked.index_copy_(0, wide, wpick)
    out.index_copy_(0, rows, picked)
    return out


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`probs` (n, c), sorted descending, keeping each row's smallest prefix whose mass reaches
    its top_p (the first candidate always stays); and the cumulative mass before the cut."""
    cum = probs.cumsum(dim=-1)
    return probs.masked_fill((cum - probs) >= top_p[:, None], 0.0), cum


def _seed_keys(requests: list[Request]) -> list[int | None]:
    """Each seeded request's key for this draw (its seed and how many draws it has made, mixed
    into 32 bits), counting the draw; None for unseeded rows."""
    out: list[int | None] = []
    for r in requests:
        if r.params.seed is None:
            out.append(None)
            continue
        out.append(_splitmix64(_splitmix64(r.params.seed) + r.seeded_draws) >> 32)
        r.seeded_draws += 1
    return out


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a well-mixed 64-bit value from any integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_M64, _M32 = (1 << 64) - 1, (1 << 32) - 1
_GOLDEN = 0x9E3779B1  # spreads consecutive token ids over 32 bits
_MIX = 0x45D9F3B  # a 32-bit integer hash's multiplier; under 2^27, so products fit in int64


def _uniforms(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) for each row's key (n,) and token id (n, c): a hash of the two in
    int64 arithmetic (every intermediate stays below 2^63), the same on every device."""
    h = (keys.unsqueeze(1) ^ (ids * _GOLDEN)) & _M32
    h = ((h ^ (h >> 16)) * _MIX) & _M32
    h = ((h ^ (h >> 16)) * _MIX) & _M32
    h = h ^ (h >> 16)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _by_cdf(probs: torch.Tensor, d: DrawPlan, pack: HostPack) -> torch.Tensor:
    """One draw per row of `probs` (n, V): the first token whose cumulative probability passes a
    uniform u (seeded rows: their own u, the hash at token id 0)."""
    u = torch.rand(probs.shape[0], dtype=probs.dtype, device=probs.device)
    if d.plain_keys is not None:
        keys, seeded = pack.get(d.plain_keys[0]), pack.get(d.plain_keys[1])
        own = _uniforms(keys, torch.zeros_like(keys).unsqueeze(1)).squeeze(1)
        u = torch.where(seeded, own, u)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _exponentials(shape: torch.Size, index: torch.Tensor, d: DrawPlan, pack: HostPack,
                  subset: torch.Tensor | None = None) -> torch.Tensor:
    """E ~ Exp(1) for each (filtered row, column) of a race whose column j of row i is token
    index[i, j]: seeded rows' from their key and the token id, the others fresh draws. `subset`:
    the race covers these filtered rows only."""
    e = torch.empty(shape, dtype=torch.float32, device=index.device)
    if d.any_unseeded:
        e.exponential_()
    if d.race_keys is not None:
        keys, seeded = pack.get(d.race_keys[0]), pack.get(d.race_keys[1])  # (f,), (f,)
        if subset is not None:
            keys, seeded = keys.index_select(0, subset), seeded.index_select(0, subset)
        own = -torch.log(_uniforms(keys, index))
        e = torch.where(seeded.unsqueeze(1), own, e) if d.any_unseeded else own
    return e


def _race(probs: torch.Tensor, e: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One token per row from (unnormalised) `probs` (n, c): the one at the argmax of p / E.
    `index`: the token id of each column (candidates, sorted)."""
    choice = (probs / e.clamp_min_(1e-30)).argmax(dim=-1, keepdim=True)
    return index.gather(1, choice).squeeze(1)
