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

import torch

from replicas.protocol import SamplingParams
from replicas.request import Request

_FIRST_ROWS = 16


@dataclass(eq=False)
class _State:
    """What one request needs each pass, built once when it is first sampled."""

    row: int | None  # its row of the count tables (penalized requests only)
    counted: int  # output tokens already added to its row
    bias_ids: torch.Tensor  # (b,) token ids of logit_bias
    bias_values: torch.Tensor  # (b,) float32
    stop_ids: torch.Tensor  # (s,) ids masked until min_tokens tokens are generated


class LogitsProcessors:
    """Applies every request's logits processing to a pass's sampling rows; owns the count table."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._states: dict[Request, _State] = {}  # requests that process logits, until they finish
        self.counts: torch.Tensor | None = None  # (rows, V) float32 (whole numbers): output tokens seen
        self.in_prompt: torch.Tensor | None = None  # (rows, V) bool: the prompt's tokens, per row
        self._free_rows: list[int] = []

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits (N, V) of `requests` -> the logits to sample from: `logits` itself when no
        request changes them, else a float32 copy with every row that asks processed."""
        self.release_finished()
        asking = [i for i, r in enumerate(requests) if r.params.processes_logits]
        if not asking:
            return logits
        device = logits.device
        states = {i: self._state(requests[i], device) for i in asking}
        bias = [i for i in asking if states[i].bias_ids.numel()]
        masked = [i for i in asking if len(requests[i].output_token_ids) < requests[i].params.min_tokens
                  and states[i].stop_ids.numel()]
        penalized = [i for i in asking if states[i].row is not None]
        if not (bias or masked or penalized):
            return logits
        out = logits.to(torch.float32, copy=True)  # the raw logits stay as they are (logprobs)
        if bias:  # logit[t] += bias[t]
            rows, ids = _flat(bias, [states[i].bias_ids for i in bias], device)
            out.index_put_((rows, ids), torch.cat([states[i].bias_values for i in bias]), accumulate=True)
        if masked:  # no EOS / stop token before min_tokens
            rows, ids = _flat(masked, [states[i].stop_ids for i in masked], device)
            out.index_put_((rows, ids), torch.tensor(float("-inf"), device=device))
        if penalized:
            self._count([requests[i] for i in penalized], [states[i] for i in penalized])
            self._penalize(out, penalized, [requests[i].params for i in penalized],
                           [states[i].row for i in penalized])
        return out

    def _penalize(self, out: torch.Tensor, rows: list[int], params: list[SamplingParams],
                  table_rows: list[int]) -> None:
        """Repetition, then frequency and presence penalties, on `out`'s `rows` in place."""
        device = out.device
        index = torch.tensor(rows, device=device)
        table = torch.tensor(table_rows, device=device)
        x = out.index_select(0, index)  # (k, V)
        counts = self.counts.index_select(0, table)  # (k, V)
        seen_out = counts > 0
        reps = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in reps):
            rep = torch.tensor(reps, device=device).unsqueeze(1)  # (k, 1)
            seen = seen_out | self.in_prompt.index_select(0, table)
            penalty = seen * rep + ~seen  # (k, V): the penalty where seen, else exactly 1
            # Positive logits divided, the others multiplied: arithmetic, not torch.where (slower on
            # CPU); -inf stays -inf.
            x = x.clamp(min=0) / penalty + x.clamp(max=0) * penalty
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if any(freq) or any(pres):
            f = torch.tensor(freq, device=device).unsqueeze(1)
            p = torch.tensor(pres, device=device).unsqueeze(1)
            x = x - (f * counts + p * seen_out)
        out.index_copy_(0, index, x)

    def _count(self, requests: list[Request], states: list[_State]) -> None:
        """Add the output tokens appended since each request's previous pass to its row."""
        rows: list[int] = []
        ids: list[int] = []
        for req, st in zip(requests, states):
            new = req.output_token_ids[st.counted:]
            if new:
                rows += [st.row] * len(new)
                ids += new
                st.counted += len(new)
        if ids:
            device = self.counts.device
            self.counts.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                                   torch.ones(len(ids), dtype=self.counts.dtype, device=device),
                                   accumulate=True)

    def _state(self, req: Request, device: torch.device) -> _State:
        st = self._states.get(req)
        if st is not None:
            return st
        p, vocab = req.params, self.vocab_size
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        stop_ids = sorted(t for t in stops if t < vocab) if p.min_tokens else []
        st = _State(None, 0, torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device),
                    torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=device),
                    torch.tensor(stop_ids, dtype=torch.long, device=device))
        if p.penalized:
            st.row = self._take_row(device)
            self.counts[st.row].zero_()
            self.in_prompt[st.row].zero_()
            self.in_prompt[st.row, torch.tensor(req.prompt_token_ids, device=device)] = True
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


def _flat(rows: list[int], ids: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for index_put_: row rows[j] repeated once per id of ids[j]."""
    lengths = torch.tensor([t.numel() for t in ids], device=device)
    return torch.repeat_interleave(torch.tensor(rows, device=device), lengths), torch.cat(ids)
