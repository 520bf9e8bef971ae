"""What one pass runs, as the scheduler hands it over: each request's tokens (`ScheduledSeq`; a
decode's one token, `DecodeSeq`), the pass (`SchedulerOutput`: decodes first, then prompt
chunks), and the counts the scheduler publishes after a change (`QueueCounts`). No torch: the
runner, the engine, the metrics and the simulator read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from replicas.protocol import ReplicaLoad
from replicas.request import Request
from replicas.scheduling.prefix_hash import PrefixSketch


@dataclass(frozen=True)
class QueueCounts:
    """The scheduler's counts after a change, as the engine publishes them: a replica's load
    record is built from them once, when it is reported (`report`)."""

    running_tokens: int  # KV tokens of the running sequences
    waiting_tokens: int  # prompt tokens the waiting requests still have to prefill
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    kv_usage: float
    prefix_hit_rate: float
    cached_blocks: int

    def report(self, *, intake_tokens: int = 0, intake_requests: int = 0, queue_bound_tokens: int | None = None,
               drain_tps: float = 0.0, prefill_tps: float = 0.0,
               prefix_sketch: PrefixSketch | None = None) -> ReplicaLoad:
        """The replica's load record. `intake_tokens` / `intake_requests`: prompts it accepted
        that have no token yet (the counts lag intake by up to a pass): the waiting count is the
        larger of the two. The rest is what the replica measures beside the scheduler."""
        return ReplicaLoad(running_tokens=self.running_tokens, waiting_tokens=max(self.waiting_tokens, intake_tokens),
                           free_blocks=self.free_blocks, total_blocks=self.total_blocks, block_size=self.block_size,
                           num_running=self.num_running, num_waiting=max(self.num_waiting, intake_requests),
                           kv_usage=self.kv_usage, queue_bound_tokens=queue_bound_tokens, drain_tps=drain_tps,
                           prefill_tps=prefill_tps, prefix_hit_rate=self.prefix_hit_rate,
                           cached_blocks=self.cached_blocks, prefix_sketch=prefix_sketch)


class ScheduledSeq:
    """`num_tokens` tokens of `request` starting at position `start` run in this pass.

    `completes`: the chunk reaches the end of the request's tokens, so the pass samples one
    (`samples`), unless the request generates nothing (max_tokens 0: its prompt is only scored).
    Fixed at scheduling time: they stay true after postprocess appends the sampled token. A
    plain class with slots: one is built per running request per pass."""

    __slots__ = ("request", "start", "num_tokens", "completes", "samples")

    def __init__(self, request: Request, start: int, num_tokens: int) -> None:
        self.request, self.start, self.num_tokens = request, start, num_tokens
        self.completes = start + num_tokens == request.num_tokens
        self.samples = self.completes and request.params.max_tokens != 0

    @staticmethod
    def decode(request: Request, start: int) -> ScheduledSeq:
        """A decode's one token (it always completes and samples): no checks to repeat."""
        seq = _new(DecodeSeq)
        seq.request, seq.start = request, start
        return seq

    def __repr__(self) -> str:
        return f"ScheduledSeq({self.request.request_id!r}, start={self.start}, num_tokens={self.num_tokens})"


class DecodeSeq(ScheduledSeq):
    """A decode's `ScheduledSeq`: one token, which completes and samples, as class constants
    (two fields set per running request per pass, not five; read-only)."""

    __slots__ = ()
    num_tokens, completes, samples = 1, True, True  # type: ignore[assignment]


_new = object.__new__


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Running requests that were decoding but get no token this pass (dynamic and static run a
    # prefill pass without the decodes; stall_free never skips one).
    num_stalled: int = 0
    # SLO admission held the queue's head back: no new request starts until a stream ends.
    head_held: bool = False

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """Decodes first, then prefill chunks: the packing order of the forward pass."""
        return self.decodes + self.prefills

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
