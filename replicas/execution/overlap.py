"""The overlapped loop's one-pass lag, in one place.

The engine launches pass N+1 before it processes pass N's outputs (SGLang's overlap scheduler,
vLLM's async scheduling). Two pieces carry the lag:

- `TokenSlots`: each runner row's latest sampled token, on the device. Pass N's sampling writes
  it; pass N+1 reads a running decode's input id from its request's row, so the token never
  makes a host round trip. Keyed by the request's runner row (its block-table row), which a
  request keeps while it runs: never a ring, never the position in a batch.
- `InFlight`: the launched pass the host has not processed yet: its batch, the runner's handle on
  the device work and the copy back, and what the engine records about the pass.

The scheduler counts a pass's sampled tokens as in flight from launch to landing
(`Request.num_inflight`): they count toward max_tokens and hold KV, and a request that stops in
pass N drops its pass N+1 token when that pass lands (`Scheduler.landed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from replicas.scheduling.pass_time import PassShape
    from replicas.request import Request
    from replicas.scheduling.batch import SchedulerOutput


class TokenSlots:
    """(rows,) int64 on the device: the token each runner row sampled last."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)

    def write(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """After sampling: tokens (N,) of the sampling rows, their runner rows `rows` (N,)."""
        if rows.numel():
            self.tokens.index_copy_(0, rows, tokens.to(self.tokens.device, torch.int64))

    def fill(self, ids: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
        """Before the forward pass: input ids[at] (packed positions of decodes whose input is in
        flight) from their runner rows' slots, in place on the device."""
        if at.numel():
            ids.index_copy_(0, at, self.tokens.index_select(0, rows))


def needs_history(req: Request) -> bool:
    """Whether this request's next pass is planned from what the pass before returned to the
    host (penalty counts, min_tokens and the grammar's state read the whole output; the prompt
    logprobs of a chunk follow the previous chunk's): such a pass waits for the one before."""
    params = req.params
    return (params.processes_logits or req.guide is not None
            or (params.prompt_logprobs is not None and req.is_prefilling))


@dataclass
class InFlight:
    """A launched pass whose outputs the host has not processed yet."""

    batch: SchedulerOutput
    handle: Any  # the runner's (ModelRunner.launch): collect() waits for it
    shape: PassShape
    predicted: float | None
    host_start: float  # perf_counter when the host began preparing it
    cpu_start: float  # process_time then
