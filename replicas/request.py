"""Request state: sampling parameters, an ordered status enum, and per-token timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOKENS_LIMIT = 1_000_000


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI / vLLM semantics).

    temperature 0 means greedy; top_k 0 means off; top_p 1.0 means off.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_QUEUE_TIMEOUT = 6  # never scheduled within EngineConfig.queue_timeout_s

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
}


@dataclass(eq=False)
class Request:
    """One generation request as the engine tracks it.

    `num_computed_tokens` counts tokens whose KV is in the cache; the request still has
    `num_tokens - num_computed_tokens` tokens to run through the model. A decoding request
    has exactly one (its last sampled token); a prefilling one has a prompt chunk to go.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # output tokens already streamed to the caller
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while a (re)computed prompt has more than the last token left to run."""
        return not self.output_token_ids or self.num_tokens_to_compute > 1

    @property
    def max_total_tokens(self) -> int:
        """KV tokens this request may ever need: prompt + every token it may generate."""
        return self.num_prompt_tokens + self.params.max_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _as_tuple(value: object, name: str, kind: type) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind):
        value = (value,)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them") from None
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them")
    return items
