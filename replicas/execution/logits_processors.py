"""Logits processors: logit_bias, min_tokens and the repetition / frequency / presence penalties.

They change the logits of the requests that ask before the sampler sees them (so before
temperature, top-k, top-p and greedy's argmax alike), with vLLM's semantics and order, each kind
one tensor operation over every row that asks:

1. logit_bias: logit[t] += bias[t];
2. min_tokens: while fewer than min_tokens tokens are generated, EOS (unless ignore_eos) and
   stop_token_ids get -inf;
3. repetition_penalty, over the tokens of the prompt and of the output so far: a positive logit
   is divided by it, a negative one multiplied (HF's and vLLM's rule);
4. logit[t] -= frequency_penalty x count[t] + presence_penalty x (count[t] > 0), count over the
   output so far (OpenAI's definition).

Output-token counts live in one (rows, V) table, a row per penalized request while it runs,
brought up to date with the tokens appended since its previous pass (one scatter-add a pass for
all of them), so no pass rebuilds counts from token lists. Log-probabilities stay raw: the
sampler's `token_logprobs` reads the logits before any of this (vLLM's raw logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replicas.request import Request
from replicas.execution.transfer import HostPack, Part, Staging

_FIRST_ROWS = 16


@dataclass(eq=False)
class _State:
    """What one request needs each pass, built once when it is first sampled (host side)."""

    row: int | None  # its row of the count tables (penalized requests only)
    counted: int  # output tokens already added to its row
    bias_ids: list[int]  # token ids of logit_bias
    bias_values: list[float]
    stop_ids: list[int]  # ids masked until min_tokens tokens are generated
    fresh: bool = True  # its count-table rows are still to be reset on the device


@dataclass
class ProcessorsPlan:
    """One pass's processing, its arrays in the pass's upload (row = row of the logits)."""

    bias: tuple[Part, Part, Part] | None  # (rows, ids, values): logit[row, id] += value
    masked: tuple[Part, Part] | None  # (rows, ids): -inf
    fresh: tuple[Part, Part, Part] | None  # (table rows to reset, their prompt's (row, id) pairs)
    counted: tuple[Part, Part] | None  # (table rows, ids): output tokens appended since last pass
    penalized: tuple[Part, Part, Part] | None  # (rows, table rows, (3, k) rep/freq/presence)
    repetition: bool
    additive: bool  # a frequency or presence penalty


class LogitsProcessors:
    """Applies every request's logits processing to a pass's sampling rows; owns the count table.

    `plan` (host) decides what each row needs and adds the arrays to the pass's upload; `apply`
    (device) edits the logits with them, one tensor operation per kind for all rows."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._states: dict[Request, _State] = {}  # requests that process logits, until they finish
        self.counts: torch.Tensor | None = None  # (rows, V) float32 (whole numbers): output tokens seen
        self.in_prompt: torch.Tensor | None = None  # (rows, V) bool: the prompt's tokens, per row
        self._free_rows: list[int] = []

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits (N, V) of `requests` -> the logits to sample from: `logits` itself when no
        request changes them, else a float32 copy with every row that asks processed (a pass of
        its own: one upload)."""
        pack = HostPack()
        plan = self.plan(requests, pack, logits.device)
        pack.send(logits.device, Staging(logits.device))
        return self.apply(logits, plan, pack)

    def plan(self, requests: list[Request], pack: HostPack, device: torch.device) -> ProcessorsPlan | None:
        """Host side: what the rows of `requests` need this pass, added to `pack`."""
        self.release_finished()
        asking = [i for i, r in enumerate(requests) if r.params.processes_logits]
        if not asking:
            return None
        states = {i: self._state(requests[i], device) for i in asking}
        bias = [i for i in asking if states[i].bias_ids]
        masked = [i for i in asking if len(requests[i].output_token_ids) < requests[i].params.min_tokens
                  and states[i].stop_ids]
        penalized = [i for i in asking if states[i].row is not None]
        if not (bias or masked or penalized):
            return None
        plan = ProcessorsPlan(None, None, None, None, None, False, False)
        if bias:
            rows, ids = _flat(bias, [states[i].bias_ids for i in bias])
            plan.bias = (pack.add(rows), pack.add(ids),
                         pack.add([v for i in bias for v in states[i].bias_values], np.float32))
        if masked:
            plan.masked = tuple(pack.add(a) for a in _flat(masked, [states[i].stop_ids for i in masked]))
        if penalized:
            reqs, sts = [requests[i] for i in penalized], [states[i] for i in penalized]
            fresh = [(r, st) for r, st in zip(reqs, sts) if st.fresh]
            if fresh:
                rows, ids = _flat([st.row for _, st in fresh], [r.prompt_token_ids for r, _ in fresh])
                plan.fresh = (pack.add([st.row for _, st in fresh]), pack.add(rows), pack.add(ids))
                for _, st in fresh:
                    st.fresh = False
            plan.counted = self._count(reqs, sts, pack)
            params = [r.params for r in reqs]
            table = np.array([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                             dtype=np.float32).T  # (3, k)
            plan.penalized = (pack.add(penalized), pack.add([st.row for st in sts]), pack.add(table))
            plan.repetition = bool((table[0] != 1.0).any())
            plan.additive = bool(table[1:].any())
        return plan

    def apply(self, logits: torch.Tensor, plan: ProcessorsPlan | None, pack: HostPack) -> torch.Tensor:
        """Device side: `logits` itself when nothing changes them, else a processed float32 copy
        (the raw logits stay as they are: logprobs read them)."""
        if plan is None:
            return logits
        out = logits.to(torch.float32, copy=True)
        if plan.bias is not None:  # logit[t] += bias[t]
            rows, ids, values = (pack.get(p) for p in plan.bias)
            out.index_put_((rows, ids), values, accumulate=True)
        if plan.masked is not None:  # no EOS / stop token before min_tokens
            rows, ids = (pack.get(p) for p in plan.masked)
            out.index_put_((rows, ids), torch.full((), float("-inf"), device=out.device))
        if plan.fresh is not None:  # a newly penalized request: its rows start from its prompt
            reset, rows, ids = (pack.get(p) for p in plan.fresh)
            self.counts.index_fill_(0, reset, 0.0)
            self.in_prompt.index_fill_(0, reset, False)
            self.in_prompt.index_put_((rows, ids), torch.ones((), dtype=torch.bool, device=out.device))
        if plan.counted is not None:
            rows, ids = (pack.get(p) for p in plan.counted)
            self.counts.index_put_((rows, ids), torch.ones((), dtype=self.counts.dtype, device=out.device),
                                   accumulate=True)
        if plan.penalized is not None:
            self._penalize(out, plan, pack)
        return out

    def _penalize(self, out: torch.Tensor, plan: ProcessorsPlan, pack: HostPack) -> None:
        """Repetition, then frequency and presence penalties, on `out`'s penalized rows in place."""
        index, table, params = (pack.get(p) for p in plan.penalized)
        x = out.index_select(0, index)  # (k, V)
        counts = self.counts.index_select(0, table)  # (k, V)
        seen_out = counts > 0
        if plan.repetition:
            seen = seen_out | self.in_prompt.index_select(0, table)
            penalty = seen * params[0].unsqueeze(1) + ~seen  # (k, V): the penalty where seen, else exactly 1
            # Positive logits divided, the others multiplied: arithmetic, not torch.where (slower on
            # CPU); -inf stays -inf.
            x = x.clamp(min=0) / penalty + x.clamp(max=0) * penalty
        if plan.additive:
            x = x - (params[1].unsqueeze(1) * counts + params[2].unsqueeze(1) * seen_out)
        out.index_copy_(0, index, x)

    def _count(self, requests: list[Request], states: list[_State], pack: HostPack) -> tuple[Part, Part] | None:
        """The output tokens appended since each request's previous pass, as (table row, id) pairs."""
        rows: list[int] = []
        ids: list[int] = []
        for req, st in zip(requests, states):
            new = req.output_token_ids[st.counted:]
            if new:
                rows += [st.row] * len(new)
                ids += new
                st.counted += len(new)
        return (pack.add(rows), pack.add(ids)) if ids else None

    def _state(self, req: Request, device: torch.device) -> _State:
        st = self._states.get(req)
        if st is not None:
            return st
        p, vocab = req.params, self.vocab_size
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        stop_ids = sorted(t for t in stops if t < vocab) if p.min_tokens else []
        st = _State(None, 0, [t for t, _ in p.logit_bias], [b for _, b in p.logit_bias], stop_ids)
        if p.penalized:
            st.row = self._take_row(device)
        self._states[req] = st
        return st

    def _take_row(self, device: torch.device) -> int:
        if self.counts is None:
            self.counts = torch.zeros((_FIRST_ROWS, self.vocab_size), dtype=torch.float32, device=device)
            self.in_prompt = torch.zeros((_FIRST_ROWS, self.vocab_size), dtype=torch.bool, device=device)
            self._free_rows = list(range(_FIRST_ROWS - 1, -1, -1))
        if not self._free_rows:  # double the tables
            n = self.counts.shape[0]
            self.counts = torch.cat((self.counts, torch.zeros_like(self.counts)))
            self.in_prompt = torch.cat((self.in_prompt, torch.zeros_like(self.in_prompt)))
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def release_finished(self) -> None:
        """Forget the requests that finished (their count rows are free again)."""
        if not self._states:
            return
        for req in [r for r in self._states if r.is_finished]:
            st = self._states.pop(req)
            if st.row is not None:
                self._free_rows.append(st.row)

    @property
    def num_tracked(self) -> int:
        """Requests whose state is kept (for tests: finished ones leave at the next pass)."""
        return len(self._states)


def _flat(rows: list[int], ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, token id) pairs for index_put_: row rows[j] repeated once per id of ids[j]."""
    lengths = [len(t) for t in ids]
    return (np.repeat(np.array(rows, dtype=np.int64), lengths),
            np.fromiter((t for group in ids for t in group), dtype=np.int64, count=sum(lengths)))
