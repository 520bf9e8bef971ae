"""Structured output through llguidance: a grammar compiled once per spec, a matcher per
request, every constrained row's token bitmask applied to the batch's logits in one call, and
each sampled token fed back to its matcher.

How a constrained request ends: EOS is masked until its grammar accepts, and the request
finishes (finish_reason "stop") the moment the grammar is complete, without waiting for an EOS.
JSON is compact (`,` and `:` separators, no whitespace outside strings), so a model cannot pad
between tokens without end (vLLM's flexible whitespace lets models loop on newlines). An output
that `max_tokens` or the context cuts ends with finish_reason "length" and is a prefix of a
valid one, as in OpenAI's API.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from replicas.protocol import GuidedDecoding, InvalidRequestError
from replicas.execution.transfer import HostPack, Staging

if TYPE_CHECKING:
    import llguidance

    from replicas.request import Request

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: `,` and `:` only
ANY_OBJECT = '{"type": "object"}'
CACHE_SIZE = 256  # compiled grammars kept per engine, least recently used dropped
# llguidance's executor fills rows on a pool of 80% of the cores (at most 32). With fewer than two
# pool threads, or few rows, one thread is faster: on 2 cores, 8 rows took 0.10 ms a pass (max
# 0.2) in a loop against 0.18 ms (max 4.6, thread wake-ups) through the pool.
POOL_THREADS = min(32, int(0.8 * (os.cpu_count() or 1)))
POOL_MIN_ROWS = 8


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of a constraint; ValueError when its text does not parse."""
    import llguidance  # on first use: a replica that never constrains output never loads it

    kind, spec = guided.kind, guided.spec
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


class Grammars:
    """Compiles constraints for one tokenizer and masks a batch's logits with them.

    The llguidance tokenizer is built on first use (a fraction of a second for a 32k
    vocabulary). Compiled grammars are kept as fresh matchers, keyed by the constraint; each
    request gets a copy. Compiling runs on the caller's thread (the replica's intake), masking
    and advancing on the engine loop's.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = tokenizer
        # The mask covers every logit column and every tokenizer id (they may differ).
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask row
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[GuidedDecoding, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    # ---- intake ----------------------------------------------------------------------

    def matcher(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        """A fresh matcher for one request; InvalidRequestError naming `guided.param` when the
        constraint does not compile (bad schema, unsupported keyword, bad regex or grammar)."""
        with self._lock:
            template = self._cache.get(guided)
            if template is None:
                template = self._compile(guided)
                self._cache[guided] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(guided)
            return template.deep_copy()

    def _compile(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        param = guided.param
        try:
            grammar = grammar_text(guided)
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: cannot be compiled: {exc}", param) from None
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer(param), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: cannot be compiled: {matcher.get_error()}", param)
        return matcher

    def _ll_tokenizer(self, param: str) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf  # imports transformers: loaded on the replica already

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            except ValueError as exc:  # a slow (Python) tokenizer
                raise InvalidRequestError(f"{param}: structured output needs this model's fast "
                                          f"tokenizer ({exc})", param, code="unsupported") from None
        return self._tokenizer

    # ---- the loop ----------------------------------------------------------------------

    def bitmask(self, requests: list[Request]) -> tuple[list[int], np.ndarray] | None:
        """The constrained rows of `requests` and their allowed tokens, (n, ceil(V / 32)) int32:
        bit k of word w allows token 32w + k. Filled on the host, applied on the device."""
        rows = [i for i, r in enumerate(requests) if r.guide is not None]
        if not rows:
            return None
        import llguidance  # loaded already: a request with a guide had its grammar compiled
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        bitmask = np.empty((len(rows), self.words), dtype=np.int32)
        if POOL_THREADS >= 2 and len(rows) >= POOL_MIN_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(POOL_THREADS)
            fill_next_token_bitmask_par(self._executor, [(requests[i].guide, j) for j, i in enumerate(rows)],
                                        bitmask)
        else:
            for j, i in enumerate(rows):
                fill_next_token_bitmask(requests[i].guide, bitmask, j)
        return rows, bitmask

    @torch.inference_mode()  # the forward pass's logits are inference tensors: edited in place
    def mask(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` (N, V) with each constrained row's disallowed tokens at -inf (a pass of its
        own: one upload). In place unless a row asks for logprobs (see `apply_bitmask`)."""
        found = self.bitmask(requests)
        if found is None:
            return logits
        pack = HostPack()
        rows, bits = pack.add(found[0]), pack.add(found[1], np.int32)
        pack.send(logits.device, Staging(logits.device))
        keep_raw = any(r.params.logprobs is not None for r in requests)
        return apply_bitmask(logits, pack.get(rows), pack.get(bits), keep_raw, len(found[0]) == len(requests))

    @staticmethod
    def advance(request: Request, token_id: int) -> bool:
        """Feed a request's sampled token to its matcher; True when its grammar is complete."""
        matcher = request.guide
        if not matcher.consume_token(token_id):  # the mask allowed it, so only a fault gets here
            log.warning("request %s: the grammar refused sampled token %d; finishing it: %s",
                        request.request_id, token_id, matcher.get_error())
            return True
        return matcher.is_stopped()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, keep_raw: bool,
                  every_row: bool) -> torch.Tensor:
    """logits (N, V) with `rows`' disallowed tokens at -inf, from their bitmask (n, words) on
    the device. In place unless `keep_raw` (a row asks for logprobs: those stay the model's own
    distribution, read from the unmasked logits); `every_row`: rows are all of them, in order."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # (n, V)
    if keep_raw:
        logits = logits.clone()
    if every_row:
        return logits.masked_fill_(~allowed, float("-inf"))
    return logits.index_put_((rows,), logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
