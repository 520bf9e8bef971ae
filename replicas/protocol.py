"""What crosses the process boundary between the HTTP ingress, the replicas and the controller.

Request and response records (`SamplingParams`, `RequestOutput`), the typed refusals a replica
answers with (each names its HTTP status, OpenAI error type, `param` and `code`), the request
limits (`Limits`), and the one load record (`ReplicaLoad`). Nothing here imports torch,
transformers or Ray: the ingress process imports this module and stays light.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from replicas.scheduling.histogram import LogHistogram
from replicas.scheduling.prefix_hash import PrefixSketch

MAX_TOKENS_LIMIT = 1_000_000
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no limit
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat top_logprobs limit; vLLM's default)
MAX_N = 128  # samples of one prompt (OpenAI's limit for n)
MAX_STOP_STRING_CHARS = 256
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
PRIORITY_RANGE = (-1_000, 1_000)
GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GUIDED_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused


# ---- refusals ----------------------------------------------------------------------------


class RequestRejected(Exception):
    """A request the engine refuses: why (`message`, the parameter at fault, a machine-readable
    `code`) and when to come back. The app maps each kind to its HTTP status (app/errors.py).

    Every constructor argument goes to `Exception.args` so the error pickles across Ray.
    """

    default_code: str | None = None

    def __init__(self, message: str, param: str | None = None, retry_after_s: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param, retry_after_s, code)
        self.message, self.param, self.retry_after_s = message, param, retry_after_s
        self.code = code or self.default_code

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(RequestRejected, ValueError):
    """The client's mistake (a limit, a bad parameter), naming the field."""

    default_code = "invalid_value"


class QueueFullError(RequestRejected):
    """The replica's waiting queue is over its token bound: come back after `retry_after_s`."""

    default_code = "rate_limit_exceeded"


class QueueTimeoutError(QueueFullError):
    """The request was not scheduled within the queue deadline, or was predicted not to be (the
    queue ahead drains too slowly): retry later."""

    default_code = "queue_timeout"


class ReplicaUnhealthyError(RequestRejected):
    """The engine loop is dead or wedged (the controller replaces the replica): a server fault,
    another replica may serve the request."""

    default_code = "engine_unavailable"


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of a request (sample j of prompt p is choice
    p * n + j; choice 0 keeps the request's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def prompt_batch(prompt_token_ids: object) -> list[list[int]]:
    """A request's prompts: one prompt (a list of token ids) or a batch of them (a list of such
    lists, completions' batched `prompt`)."""
    if isinstance(prompt_token_ids, (list, tuple)) and prompt_token_ids and \
            isinstance(prompt_token_ids[0], (list, tuple)):
        return [list(p) for p in prompt_token_ids]
    return [prompt_token_ids]  # type: ignore[list-item]


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param)


# ---- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output: the generated text must match this grammar. Checked for shape here;
    compiled on the replica, where the tokenizer is (`replicas.execution.guided`), before the request is
    acknowledged, so a grammar that does not compile is a 400 naming `param`.

    kind `json_schema`: `spec` is the schema as JSON text; `json_object`: any JSON object (no
    spec); `regex`: the whole output matches it (Rust `regex` syntax); `choice`: exactly one of
    the strings in `spec`; `grammar`: a Lark or GBNF grammar. `param` is the request field the
    constraint came from (`response_format`, `guided_json`, `tools`, ...).
    """

    kind: str
    spec: str | tuple[str, ...] = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        kind, spec, param = self.kind, self.spec, self.param
        if kind not in GUIDED_KINDS:
            raise _invalid(param, f"kind must be one of {', '.join(GUIDED_KINDS)}, got {kind!r}")
        if kind == "choice":
            object.__setattr__(self, "spec", spec := _as_tuple(spec, param, str))
            if not spec or not all(spec):
                raise _invalid(param, "must be a non-empty list of non-empty strings")
            size = sum(len(c) for c in spec)
        elif kind == "json_object":
            if spec:
                raise _invalid(param, "json_object takes no schema")
            size = 0
        else:
            if not isinstance(spec, str) or not spec:
                raise _invalid(param, f"must be a non-empty string for kind {kind}")
            size = len(spec)
        if size > MAX_GUIDED_SPEC_CHARS:
            raise _invalid(param, f"is {size} characters, more than the {MAX_GUIDED_SPEC_CHARS} accepted")
        if kind == "json_schema":
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise _invalid(param, f"schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise _invalid(param, "schema must be a JSON object")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI / vLLM semantics), checked when built.

    temperature 0 means greedy; top_k 0 means off; top_p 1.0 means off. max_tokens None means
    as many as the context and the KV cache leave (resolved by the replica that serves it);
    0 means nothing is generated: the prompt is only run through the model (to score it, with
    `prompt_logprobs`) and the request finishes with "length".

    Logits processing (vLLM's semantics, applied batched before temperature/top-k/top-p and
    before greedy's argmax, in this order): `logit_bias` added to the logits; EOS and
    `stop_token_ids` masked while fewer than `min_tokens` tokens are generated (stop strings are
    not looked for before then either); `repetition_penalty` over the prompt's and the output's
    tokens (a positive logit divided by it, a negative one multiplied); then
    logit -= frequency_penalty x count + presence_penalty x (count > 0) over the output's tokens.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of each generated token and of the `logprobs` most likely alternatives
    # (0: the chosen token's only). None: none computed. Raw: the model's own distribution,
    # before the logits processing below and temperature, top-k and top-p (vLLM's default).
    logprobs: int | None = None
    # The same for each prompt token after the first (its logprob given the tokens before it),
    # computed in the prefill passes. None: none computed (and no prompt logits kept).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension; 1 is off
    # Token id -> bias added to its logit (a mapping is accepted and frozen into sorted pairs;
    # ids are checked against the vocabulary by the replica, `Limits.check_token_ids`).
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # vLLM's extension
    # Samples of the prompt: its prefill runs once, the others fork from its cached blocks; with a
    # seed, sample j draws from seed + j.
    n: int = 1
    # Structured output (a JSON schema, regex, choice or grammar); None: free text.
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or not 0 <= self.max_tokens <= MAX_TOKENS_LIMIT):
            raise _invalid("max_tokens", f"must be an integer in [0, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise _invalid("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _invalid("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise _invalid("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise _invalid("stop", f"strings must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _invalid(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not low <= value <= high:
                raise _invalid(name, f"must be in [{low:g}, {high:g}], got {value!r}")
        rep = self.repetition_penalty
        if not _is_num(rep) or not 0.0 < rep < float("inf"):
            raise _invalid("repetition_penalty", f"must be > 0 (1 disables it), got {rep!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _invalid("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"must not exceed max_tokens ({self.max_tokens}), "
                           f"got {self.min_tokens}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise _invalid("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise _invalid("guided", "must be a GuidedDecoding")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A penalty over the tokens seen so far applies (they are counted for this request)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Anything changes this request's logits before sampling (`replicas.execution.logits_processors`)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a replica: one check for the engine, the replica and the
    simulator. Derived from the model and `EngineConfig` (`Engine.limits`)."""

    max_model_len: int
    max_batch_total_tokens: int  # KV capacity in tokens
    max_batch_prefill_tokens: int
    policy: str
    vocab_size: int | None = None  # None: prompt token ids are not range-checked

    def room(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt this long may generate."""
        return min(self.max_model_len, self.max_batch_total_tokens) - num_prompt_tokens

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """`requested`, or what the prompt leaves when it is None; raises when over a limit."""
        if requested is None:
            requested = max(1, min(self.room(num_prompt_tokens), MAX_TOKENS_LIMIT))
        self.check(num_prompt_tokens, requested)
        return requested

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens <= 0:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
                "max_tokens). Please reduce the prompt or max_tokens.", "max_tokens")
        if total > self.max_batch_total_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens ({num_prompt_tokens} + {max_tokens}) exceeds "
                f"the KV cache capacity (max_batch_total_tokens = {self.max_batch_total_tokens})",
                "max_tokens")
        mbp = self.max_batch_prefill_tokens
        if self.policy == "dynamic" and num_prompt_tokens > mbp:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens, more than max_batch_prefill_tokens = "
                f"{mbp}, which the dynamic policy prefills in one pass", "prompt")

    def check_prompt_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        if vocab is not None and not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")

    def check_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's parameters name exist in this model's vocabulary."""
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias if vocab is not None and t >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}), got {bad[0]}",
                                      "logit_bias")


def check_priority(priority: object) -> int:
    if not _is_int(priority) or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidRequestError(f"priority must be an integer in {list(PRIORITY_RANGE)}, "
                                  f"got {priority!r}", "priority")
    return priority  # type: ignore[return-value]


# ---- responses ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class RequestOutput:
    """What one iteration produced for one request (a streaming delta). Built by keyword: it
    crosses processes, and its fields grow."""

    request_id: str
    # None: not decoded yet; the engine left it to its caller (`OutputProcessor.deltas_by_caller`),
    # whose stream fills it in (`outputs.StreamText`) before anyone reads it.
    delta_text: str | None
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None
    # With SamplingParams.logprobs: one TokenLogprob per token of delta_token_ids.
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs, on the first output once the prompt is computed: one
    # TokenLogprob per prompt token (the first one's logprob None: nothing comes before it).
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    index: int = 0  # which of the prompt's n samples (SamplingParams.n) this is
    # On a stream's first output: when the request left the replica's queue (the replica's wall
    # clock, that of its load reports, so the door can tell which report still counted it).
    left_queue_at: float | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One delta carrying this one and the `later` one of the same request."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return RequestOutput(
            request_id=self.request_id,
            delta_text=None if self.delta_text is None else self.delta_text + later.delta_text,
            delta_token_ids=self.delta_token_ids + later.delta_token_ids, finished=later.finished,
            finish_reason=later.finish_reason, num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens, stop_reason=later.stop_reason, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            num_cached_tokens=later.num_cached_tokens, index=later.index,
            left_queue_at=self.left_queue_at or later.left_queue_at)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely alternatives', with their text (each
    token decoded on its own) so the edge needs no tokenizer to format them."""

    token_id: int
    token: str
    logprob: float | None  # None only for a prompt's first token, which nothing scores
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), most likely first


@dataclass(frozen=True, kw_only=True)
class Acknowledged:
    """The first item of a stream, before any output: the request is queued on `replica_id` at
    `at` (the replica's wall clock, the clock of its load reports, so a reader can tell whether a
    report counts this request). A caller learns of a refusal before it commits to a 200."""

    request_id: str
    replica_id: str | None
    at: float


# ---- load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load: built once by the replica from its scheduler's counts, its intake
    queue, queue bound and rates (`scheduler.QueueCounts.report`), completed by its reporter
    (TBT histogram, pass times, replica id, wall-clock `timestamp`), then read as-is by the
    controller, the router, the door's admission and the simulator.

    Token load = running tokens (KV tokens of running sequences) + waiting tokens (prompt
    tokens still to prefill, including requests accepted but not yet in the scheduler).
    """

    replica_id: str = ""
    running_tokens: int = 0
    waiting_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    # Waiting prompt tokens it admits (replicas.scheduling.admission.queue_bound; 0: only while its queue is
    # empty, a stalled queue); None: not reported (the scheduler's own share of a report).
    queue_bound_tokens: int | None = None
    drain_tps: float = 0.0  # waiting prompt tokens it prefills per second lately
    prefill_tps: float = 0.0  # prompt tokens per second its pass-time model predicts; 0: no model
    # The TBT gaps new since this replica's previous report, binned (None: none; the controller
    # keeps them in its windows and hands the load on without them).
    tbt_histogram: LogHistogram | None = None
    iterations: int = 0  # forward passes since the previous report
    iteration_mean_s: float = 0.0
    iteration_max_s: float = 0.0
    timestamp: float = 0.0
    # Prefix cache: the share of looked-up prompt tokens found cached, the blocks registered, and
    # a Bloom filter of their hashes (refreshed at most every ~0.1 s) for prefix-aware routing.
    prefix_hit_rate: float = 0.0
    cached_blocks: int = 0
    prefix_sketch: PrefixSketch | None = None

    @property
    def token_load(self) -> int:
        return self.running_tokens + self.waiting_tokens

    @property
    def free_kv_tokens(self) -> int:
        return self.free_blocks * self.block_size


# ---- checks ------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _as_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping (or pairs) as sorted (id, bias) pairs, each checked."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = dict(items)  # type: ignore[arg-type]  # a repeated id: the last one counts
    except (TypeError, ValueError):
        raise _invalid("logit_bias", "must map token ids to biases") from None
    low, high = LOGIT_BIAS_RANGE
    for token, bias in pairs.items():
        if not _is_int(token) or token < 0:
            raise _invalid("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
        if not _is_num(bias) or not low <= bias <= high:
            raise _invalid("logit_bias", f"values must be in [{low:g}, {high:g}], got {bias!r} "
                           f"for token {token}")
    return tuple(sorted((t, float(b)) for t, b in pairs.items()))


def _as_tuple(value: object, name: str, kind: type) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind):
        value = (value,)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise _invalid(name, f"must be a {kind.__name__} or a list of them") from None
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise _invalid(name, f"must be a {kind.__name__} or a list of them")
    return items
