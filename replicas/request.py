"""Request state: an ordered status enum and the per-request record the engine tracks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replicas.protocol import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

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
        return self in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


FINISHED = frozenset(s for s in RequestStatus if s > RequestStatus.PREEMPTED)  # a set: cheap per pass

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
}


@dataclass(eq=False, slots=True)
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
    sent_at: float = float("-inf")  # perf_counter when its latest delta went out
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    stop_reason: str | int | None = None
    # How many draws a seeded request has made: with its seed, the key of its next draw's
    # randomness (the sampler's `_seed_keys`), so its tokens do not depend on its batch.
    seeded_draws: int = 0
    # With params.logprobs: (logprob of each output token, ((id, logprob) of the top alternatives)).
    output_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    # With params.prompt_logprobs: the same for prompt tokens 1, 2, ... (token 0 has none), appended
    # as prefill chunks run; its length is the next prompt position whose logits are kept.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    # Hashes of the request's full KV blocks (prefix caching), computed once as they are needed.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    # Which choice of its client request this is (n samples of batched prompts: protocol.sample_id).
    index: int = 0
    # A sample forked from the first sample of the same prompt waits for that one's prefill, then
    # finds the prompt's blocks cached (a fork, no copy).
    forked_from: Request | None = None
    # Choice 0 of the same client request; None for choice 0 itself. Once it has been scheduled
    # the client has a stream, so this choice no longer expires in the queue.
    first_choice: Request | None = None
    # With params.guided: the grammar's state after the output so far (replicas.execution.guided).
    guide: LLMatcher | None = None
    # The token ids that end it (stop_token_ids, and EOS unless ignore_eos: set by the engine when
    # it queues the request), so each pass checks a token with one lookup.
    stop_ids: frozenset[int] = frozenset()
    # The most output tokens it may have: max_tokens, which the engine caps by the context's room
    # when it queues the request.
    max_output: int = -1
    # Tokens sampled by a pass that was launched but whose outputs are not processed yet (0 or 1:
    # the overlapped loop runs one pass ahead). They count in `num_tokens` (their KV is reserved,
    # the next decode runs them, `max_tokens` counts them) but not in `output_token_ids`: the
    # value lives on the device until the pass lands (`overlap.InFlight`).
    num_inflight: int = 0
    # Its deltas leave the loop as `outputs.Delta`s, built and decoded by its caller (set by
    # `OutputProcessor.add`).
    by_caller: bool = False
    # Set from its params (`__post_init__`): see there.
    argmax_only: bool = field(init=False)
    plain_stops: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        if self.max_output < 0:
            self.max_output = params.max_tokens
        # Its token is the logits' argmax and nothing else reads them: no sampling, no logprobs,
        # no logits processing, no grammar (a pass of only such rows skips those steps).
        self.argmax_only = (params.greedy and params.logprobs is None and not params.processes_logits
                            and params.guided is None)
        # Only a stop token, EOS or max_tokens can end it after a pass (no stop strings, no grammar,
        # no min_tokens): postprocess rules the rest out without the whole stop check.
        self.plain_stops = not params.stop and params.guided is None and params.min_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, those still in flight included."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def num_tokens_to_compute(self) -> int:
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight
                - self.num_computed_tokens)

    @property
    def is_prefilling(self) -> bool:
        """True while a (re)computed prompt has more than the last token left to run."""
        out = len(self.output_token_ids) + self.num_inflight  # read per running request per pass
        return not out or len(self.prompt_token_ids) + out - self.num_computed_tokens > 1

    @property
    def max_total_tokens(self) -> int:
        """KV tokens this request may ever need: prompt + every token it may generate."""
        return self.num_prompt_tokens + self.max_output

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without concatenating them."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return [*prompt[start:], *self.output_token_ids[:end - n]]  # the prompt may be a range

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
