"""Incremental detokenization that never splits a UTF-8 character, with stop-string hold-back."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# Trailing prompt tokens decoded as context so the first output token gets its leading
# space right (sentencepiece-style tokenizers drop it when a token is decoded alone).
_CONTEXT_TOKENS = 5
# A token that leaves the text ending in U+FFFD is held back until the next ones complete the
# character. A UTF-8 character has at most 4 bytes and a token carries at least one, so a valid
# character never holds more than 3 tokens; a longer held run is lone bytes that will never decode
# (a degenerate output; with random weights, hundreds of tokens): past this many held tokens, the
# text before the last 3 is final and goes out, instead of the whole run waiting for the finish
# and being re-decoded at every token (SGLang fixed the same hold in its detokenizer).
_MAX_HELD_TOKENS = 6
_TAIL_TOKENS = 3
# After a delta whose one step could not be kept (`_step_all`), this many deltas step token by
# token before it is tried again.
_SKIP_AFTER_FAILED_TRY = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    The ids it keeps (`ids`: the prompt's tail, then every output token) are an `array`, which
    the garbage collector visits in one step (it holds no objects), where it follows a list's
    every item: a stream lives for seconds, and lists of hundreds of ids per stream made up a
    third of what each young collection followed in a busy replica
    (`replicas/serving/startup_gc.py`).

    Decodes a short window (prefix_offset..end) and emits only what extends the previous
    window's text; if the new text ends in U+FFFD the token split a multi-byte character,
    so nothing is emitted until the next token completes it. With a fast tokenizer that does not
    override decoding, `tokenizers`' DecodeStream runs that same algorithm in Rust, one call a
    token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self.ids = token_array(prompt_ids[-_CONTEXT_TOKENS:])
        self._num_context = len(self.ids)  # `ids` is these, then every output token added
        self._stream = _decode_stream(self.ids.tolist()) if self._backend_decode is not None else None
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded text not handed out yet (cut at a stop string)
        self._releasing = False  # inside a held run that `_release_held` hands out token by token
        self._skip_tries = 0  # deltas stepped token by token before `_step_all` is tried again

    def _decode(self, ids: Sequence[int]) -> str:
        ids = _as_list(ids)
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int, find_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one (looked for
        in the text this token completes, and only when `find_stop`: not before min_tokens)."""
        ids = self.ids
        ids.append(token_id)
        if self._stream is not None:
            chunk = self._stream.step(self._backend, token_id)
            if chunk is not None:
                self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)  # for `flush`
                self.read_offset = len(ids)
        else:
            prefix = self._decode(ids[self.prefix_offset:self.read_offset])
            new = self._decode(ids[self.prefix_offset:])
            chunk = None
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                chunk = new[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self._releasing = False
        held = len(ids) - self.read_offset
        if chunk is None and held > (_TAIL_TOKENS if self._releasing else _MAX_HELD_TOKENS):
            chunk = self._release_held()  # then each token while the run lasts, 3 tokens behind
        if chunk is None:
            return None
        if chunk:
            # A stop string ending in `chunk` starts at most `hold` characters before it, and
            # `take_delta` never hands out the last `hold`: all of it is in `pending`.
            before = len(self.pending)
            self.pending += chunk
            if find_stop and self.stop:
                hit = find_stop_string(self.pending, self.stop, before)
                if hit is not None:
                    self.pending = self.pending[:hit[0]]
                    return hit[1]
        return None

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Add the output tokens not added yet (a request without stop strings is detokenized
        only when a delta of it goes out: the same tokens in the same order, so the same text).
        `add_token`'s steps without stop strings, inlined: one call for a delta's tokens."""
        added, n = len(self.ids) - self._num_context, len(output_ids)
        if added >= n:
            return
        if self.stop or self._stream is None:
            for token_id in output_ids[added:]:
                self.add_token(token_id, find_stop=False)
            return
        if n - added > 1:
            if self._skip_tries:
                self._skip_tries -= 1
            elif self._step_all(output_ids[added:]):
                return
            else:  # output that breaks characters (lone bytes) fails the try often: it costs a copy and a step
                self._skip_tries = _SKIP_AFTER_FAILED_TRY
        # The offsets live in locals for the walk (a few hundred tokens a pass): stored once.
        ids, backend, step = self.ids, self._backend, self._stream.step
        pending, read, prefix = self.pending, self.read_offset, self.prefix_offset
        limit = _TAIL_TOKENS if self._releasing else _MAX_HELD_TOKENS
        size = len(ids)
        for token_id in output_ids[added:]:
            ids.append(token_id)
            size += 1
            chunk = step(backend, token_id)
            if chunk is not None:
                prefix = read - _CONTEXT_TOKENS if read > _CONTEXT_TOKENS else 0  # for `flush`
                read = size
                pending += chunk
            elif size - read > limit:
                self.prefix_offset, self.read_offset = prefix, read
                chunk = self._release_held()  # None: nothing changed
                if chunk is not None:  # released: the windowed decode from here (`add_token`)
                    self.pending = pending + chunk
                    for rest in output_ids[size - self._num_context:]:
                        self.add_token(rest, find_stop=False)
                    return
        self.prefix_offset, self.read_offset, self.pending = prefix, read, pending

    def _step_all(self, new: Sequence[int]) -> bool:
        """The delta's tokens through a copy of the Rust stream in one step (half the time of a
        step each), kept when that gives what the steps one by one give: text that ends whole
        and holds no U+FFFD (so no step held a run long enough to be released). Else nothing
        changes (False) and the caller steps them one by one."""
        stream = self._stream
        try:
            trial = stream.__copy__()
            chunk = trial.step(self._backend, _as_list(new))
        except (AttributeError, TypeError):  # tokenizers without copies or list steps
            return False
        if chunk is None or "\ufffd" in chunk:
            return False
        self._stream = trial
        self.ids.extend(new)
        read = self.read_offset
        self.prefix_offset = read - _CONTEXT_TOKENS if read > _CONTEXT_TOKENS else 0  # for `flush`
        self.read_offset = len(self.ids)
        self.pending += chunk
        return True

    def delta(self, output_ids: Sequence[int], finished: bool, flush: bool = False) -> str:
        """A delta's text: the output tokens not added yet (`catch_up`), everything when
        `flush` (`flush`), then what `take_delta` hands out. One call per delta; a delta of one
        token without stop strings (one every pass) takes the Rust stream's step inline."""
        ids = self.ids
        if (len(ids) - self._num_context + 1 == len(output_ids) and not self.stop and not flush
                and self._stream is not None):
            ids.append(output_ids[-1])
            chunk = self._stream.step(self._backend, output_ids[-1])
            if chunk is not None:
                self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)  # for `flush`
                self.read_offset = len(ids)
            elif len(ids) - self.read_offset > (_TAIL_TOKENS if self._releasing else _MAX_HELD_TOKENS):
                chunk = self._release_held()
            pending = self.pending
            if pending:
                chunk, self.pending = pending + (chunk or ""), ""
            return chunk or ""  # nothing held back: no stop strings
        self.catch_up(output_ids)
        if flush:
            self.flush()
        return self.take_delta(finished)

    def _release_held(self) -> str | None:
        """A long held run: the text of all but its last `_TAIL_TOKENS` tokens, if that is where
        the whole window's text starts (no character spans the cut), is final; hand it out and
        restart the window at the cut. None when nothing new is settled."""
        ids, start = self.ids, self.prefix_offset
        cut = len(ids) - _TAIL_TOKENS
        prefix = self._decode(ids[start:self.read_offset])
        settled = self._decode(ids[start:cut])
        if len(settled) <= len(prefix) or not self._decode(ids[start:]).startswith(settled):
            return None
        chunk = settled[len(prefix):]
        self.prefix_offset, self.read_offset = max(0, cut - _CONTEXT_TOKENS), cut
        # The Rust stream cannot be restarted from here (a prefilled stream re-emits a context that
        # ends in U+FFFD): the rest of this output goes through the windowed decode.
        self._stream = None
        self._releasing = True
        return chunk

    def flush(self) -> None:
        """At finish: take whatever the last tokens decode to, even a partial character."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new = self._decode(self.ids[self.prefix_offset:])
            self.pending += new[len(prefix):]
            self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, holding back what could still become a stop string."""
        pending = self.pending
        end = len(pending) if finished else len(pending) - self.hold
        if end <= 0:
            return ""
        self.pending = pending[end:]
        return pending[:end]


def token_array(ids: Sequence[int] = ()) -> array:
    """Token ids as a growable array of 64-bit ints: one reference for the garbage collector to
    follow (its type), however many ids it holds; a list has one per id."""
    return array("q", ids)


def _as_list(ids: Sequence[int]) -> Sequence[int]:
    """`ids` as the Rust tokenizer takes them: an array's as a list."""
    return ids.tolist() if isinstance(ids, array) else ids


def _backend_decode(tokenizer: PreTrainedTokenizerBase):  # noqa: ANN202 - a bound Rust method
    """The Rust backend's `decode` when it gives the same text as `tokenizer.decode(...,
    clean_up_tokenization_spaces=False)` (a fast tokenizer whose class does not override
    decoding), without the Python wrapper's per-call cost; else None."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerFast.decode:
        return None
    return getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)


def _decode_stream(context_ids: list[int]):  # noqa: ANN202 - tokenizers.decoders.DecodeStream
    try:
        from tokenizers.decoders import DecodeStream
        return DecodeStream(ids=context_ids, skip_special_tokens=True)
    except (ImportError, TypeError):  # tokenizers too old for a prefilled stream
        return None


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `search_from`; (index, stop) or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
