"""A pass's results as its requests' streams see them: stop checks, the text so far, and the
deltas (`RequestOutput`) a stream receives, each token's or a stream interval's worth at once.

The engine's postprocess calls `check_stop` for every request that got a token and `emit` for
those whose delta goes out. A request without stop strings is detokenized only when a delta of
it goes out (the same tokens in the same order: the same text), or not at all when
`deltas_by_caller`: then a request that needs nothing from the loop but its tokens (no stop
strings, no logprobs) leaves each delta as a `Delta` (which request, which of its tokens), and
the caller builds the `RequestOutput` and decodes its text (`StreamText`) off the engine's loop,
as vLLM's front end builds its outputs and SGLang's detokenizer process decodes. Text that
decides when a request stops (stop strings) is always decoded here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from replicas.detokenizer import IncrementalDetokenizer, token_array
from replicas.protocol import RequestOutput, TokenLogprob
from replicas.request import Request, RequestStatus

if TYPE_CHECKING:  # torch's: a replica serving HTTP beside its engine process never loads it
    from replicas.execution.guided import Grammars

_STOPPED, _LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def merged_due(now: float, last_landed: float, interval: float) -> float:
    """A running stream's delta goes out at this landing if it was last sent at or before the
    returned time: at the landing nearest its due time (`interval` after the last one), early by
    up to half a pass rather than late by up to a whole one. The next landing is taken to come
    as long after this one as this one came after `last_landed`, counted at most a whole
    interval (so deltas go out at least half an interval apart). The chunks of a stream then
    come `interval` apart on average, and at most `interval` plus half a pass (while passes are
    shorter than it), where holding every delta until it is due, as before, let them come up to
    `interval` plus a whole pass apart: a gap of nearly twice the interval under load."""
    return now - interval + min(now - last_landed, interval) / 2


class Delta:
    """A delta as the loop leaves it for its caller (`OutputProcessor.deltas_by_caller`): the
    request's output tokens `start:end`, and whether it finished with them. The caller builds
    the `RequestOutput` (`output`), reading the request while the loop goes on: only what a
    delta's end fixes (output tokens before `end` are never changed, a finished request's
    reasons never again)."""

    __slots__ = ("request_id", "req", "start", "end", "finished")

    def __init__(self, req: Request, start: int, end: int, finished: bool) -> None:
        self.request_id, self.req, self.start, self.end, self.finished = req.request_id, req, start, end, finished

    def followed_by(self, later: Delta) -> Delta:
        """One delta carrying this one's tokens and the `later` one's."""
        return Delta(self.req, self.start, later.end, later.finished)

    def output(self) -> RequestOutput:
        """The `RequestOutput` it stands for, its text not decoded yet (`StreamText.fill`)."""
        return output_of(self.fields())

    def fields(self) -> tuple:
        """The `RequestOutput` it stands for as a tuple (`output_of` builds it): what crosses to
        the replica's process from an engine in its own (`replica.engine_process`), cheaper to
        pickle than the object."""
        req, finished = self.req, self.finished
        return (self.request_id, req.output_token_ids[self.start:self.end], finished,
                req.finish_reason if finished else None, len(req.prompt_token_ids), self.end,
                req.stop_reason if finished else None, req.num_cached_tokens, req.index)


def output_of(fields: tuple) -> RequestOutput:
    """The `RequestOutput` of a `Delta.fields` tuple, its text not decoded yet."""
    rid, ids, finished, reason, num_prompt, num_output, stop, cached, index = fields
    return RequestOutput(request_id=rid, delta_text=None, delta_token_ids=ids, finished=finished,
                         finish_reason=reason, num_prompt_tokens=num_prompt, num_output_tokens=num_output,
                         stop_reason=stop, num_cached_tokens=cached, index=index)


class OutputProcessor:
    """Each queued request's detokenizer, and the deltas built from its tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, grammars: Grammars) -> None:
        self.tokenizer, self.grammars = tokenizer, grammars
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._token_texts: dict[int, str] = {}  # each token decoded on its own (logprobs)
        # The deltas of requests without stop strings or logprobs go out as `Delta`s, for the
        # caller to build and decode (the async engine sets it: its streams do it on their own loop).
        self.deltas_by_caller = False

    def add(self, req: Request) -> None:
        params = req.params
        if params.stop or not self.deltas_by_caller:
            self.detoks[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop)
        else:
            req.by_caller = params.logprobs is None and params.prompt_logprobs is None

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Whether the request's latest token ends it: a stop string, a stop token or EOS (not
        before min_tokens), its grammar complete, or max_tokens reached."""
        out = req.output_token_ids
        n_out = len(out)
        if n_out:  # none: a prompt only scored (max_tokens 0)
            token, params = out[-1], req.params
            # As vLLM: nothing stops the first min_tokens tokens (EOS and stop ids are masked too).
            may_stop = n_out > params.min_tokens
            if params.stop:  # else its text waits for its next delta (`emit`)
                stop = self.detoks[req.request_id].add_token(token, find_stop=may_stop)
                if stop is not None:
                    req.stop_reason = stop
                    return _STOPPED
            if may_stop and token in req.stop_ids:
                req.stop_reason = token if token in params.stop_token_ids else None
                return _STOPPED
            if req.guide is not None and self.grammars.advance(req, token):  # its grammar is complete
                return _STOPPED
        if n_out >= req.max_output:
            return _LENGTH
        return None

    def emit(self, req: Request) -> RequestOutput | Delta:
        """The request's delta since the last one; a finished request's last (its detokenizer goes)."""
        if req.by_caller:
            start, end = req.num_sent_tokens, len(req.output_token_ids)
            req.num_sent_tokens = end
            return Delta(req, start, end, req.status >= _STOPPED)
        rid = req.request_id
        out_ids = req.output_token_ids
        finished = req.status >= _STOPPED
        detok = self.detoks.pop(rid, None) if finished else self.detoks.get(rid)
        if detok is None:  # the caller decodes it (`deltas_by_caller`)
            text = None
        elif finished:  # a stop string already cut the text; anything else keeps it all
            text = detok.delta(out_ids, True, flush=not isinstance(req.stop_reason, str))
        else:
            text = detok.delta(out_ids, False)
        n_out = len(out_ids)
        sent = req.num_sent_tokens
        params = req.params
        # The prompt's logprobs go with the first output after it is computed.
        scored = (params.prompt_logprobs is not None and sent == 0
                  and req.num_computed_tokens >= req.num_prompt_tokens)
        out = RequestOutput(
            request_id=rid, delta_text=text, delta_token_ids=out_ids[sent:],
            finished=finished, finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=n_out, stop_reason=req.stop_reason,
            logprobs=self._logprobs(req, sent) if params.logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(req) if scored else None,
            num_cached_tokens=req.num_cached_tokens, index=req.index)
        req.num_sent_tokens = n_out
        return out

    def _logprobs(self, req: Request, start: int) -> list[TokenLogprob]:
        """The output tokens from `start` on, with their logprobs and each token's text."""
        return [self._token_logprob(tok, lp, top)
                for tok, (lp, top) in zip(req.output_token_ids[start:], req.output_logprobs[start:])]

    def _prompt_logprobs(self, req: Request) -> list[TokenLogprob]:
        """Every prompt token with its logprob (the first one: None) and top alternatives."""
        ids = req.prompt_token_ids
        return [self._token_logprob(ids[0], None, ())] + [
            self._token_logprob(tok, lp, top) for tok, (lp, top) in zip(ids[1:], req.prompt_logprobs)]

    def _token_logprob(self, token_id: int, logprob: float | None,
                       top: tuple[tuple[int, float], ...]) -> TokenLogprob:
        text = self.token_text
        return TokenLogprob(token_id, text(token_id), logprob, tuple((i, text(i), v) for i, v in top))

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:  # at most one decode per vocabulary entry (a scored prompt has many)
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text


class StreamText:
    """One stream's deltas that the loop left to its caller (`OutputProcessor.deltas_by_caller`),
    built and their text decoded where the stream is read: each sample's own detokenizer, fed the
    same tokens in the same order as the engine's would be, so the same text. A delta that has its
    text already (a request with stop strings) passes through."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompts: dict[str, Sequence[int]]) -> None:
        """`prompts`: the prompt of each request whose text is decoded here (`of` picks them)."""
        self._tokenizer = tokenizer
        self._prompts = prompts
        self._detoks: dict[str, tuple[IncrementalDetokenizer, array]] = {}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, reqs: list[Request]) -> StreamText:
        """The stream of `reqs`: those without stop strings are decoded here (the loop decodes
        the others' text, which decides when they stop)."""
        return cls(tokenizer, {r.request_id: r.prompt_token_ids for r in reqs if not r.params.stop})

    def fill(self, out: RequestOutput | Delta) -> RequestOutput:
        if isinstance(out, Delta):
            out = out.output()
        elif out.delta_text is not None:
            return out
        rid = out.request_id
        state = self._detoks.get(rid)
        if state is None:  # its first delta: its detokenizer starts from the prompt's tail
            state = self._detoks[rid] = (IncrementalDetokenizer(self._tokenizer, self._prompts.pop(rid)), token_array())
        detok, ids = state
        ids.extend(out.delta_token_ids)
        out.delta_text = detok.delta(ids, out.finished, flush=out.finished)
        if out.finished:
            del self._detoks[rid]
        return out
