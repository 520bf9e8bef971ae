"""Tensor parallelism: one replica's model sharded over `tensor_parallel_size` ranks.

Rank 0 is the engine: scheduler, block manager, sampler, detokenizer, and a model runner like
any other. Ranks 1..tp-1 are workers (`replicas.execution.parallel_workers`) that hold their
shard of the weights (transformers' own plan, `loading.models.load_model`) and their share of
the KV cache (heads / tp), and replay each pass's forward only; transformers' sharded layers
all-reduce inside the forward, and the logits come out whole on every rank (the LM head gathers
its vocabulary shards), so rank 0 samples as it would alone and the workers drop theirs.

Each pass is ONE message from rank 0 (nano-vllm's shape, a collective instead of shared memory):
the pass's upload (`transfer.HostPack`: ids, positions, slots, block tables, keep rows, all in
one byte buffer) with a small header saying where each part lies, broadcast in one collective
on a gloo group of its own (host memory on every backend; the model's collectives use the
default group, nccl on CUDA). A worker uploads the same bytes to its device and runs the same
`ModelRunner.forward`, so its KV writes land in the same slots as rank 0's.

The message buffer has a fixed capacity both sides know; a larger message first sends a resize.

The overlapped loop (`engine.overlap`): a pass's decodes may take their input token from the pass
before, still on the device (`overlap.TokenSlots`). Rank 0 samples; so after each pass that keeps
token slots it broadcasts the sampled tokens (N int64, on the device: nccl on CUDA, no host round
trip) and every worker writes them into its own slots, rows as rank 0's. The next message then
finds every rank's slots alike.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# Message kinds (the header's first field).
PASS, BUILD, LOAD, STOP, RESIZE = range(1, 6)
KIND_NAMES = {PASS: "pass", BUILD: "build", LOAD: "load", STOP: "stop", RESIZE: "resize"}
_HEAD = struct.Struct("<QII")  # total bytes, kind, header bytes
_ALIGN = 8
INITIAL_CAPACITY = 1 << 16
# No rank waits longer than this in a collective, joining included (a worker's start: a process,
# torch and transformers imported). A dead peer fails gloo's collectives at once, well before.
COLLECTIVE_TIMEOUT_S = 120.0
IDLE_WAIT = timedelta(days=365)


def encode(kind: int, header: Any, body: np.ndarray | None = None) -> np.ndarray:
    """One message as bytes: a fixed head, the pickled header, the body 8-byte aligned."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    start = -(-(_HEAD.size + len(head)) // _ALIGN) * _ALIGN
    raw = body.reshape(-1).view(np.uint8) if body is not None else np.empty(0, np.uint8)
    out = np.zeros(start + raw.nbytes, dtype=np.uint8)
    _HEAD.pack_into(out, 0, out.nbytes, kind, len(head))
    out[_HEAD.size:_HEAD.size + len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[start:] = raw
    return out


def decode(buf: np.ndarray) -> tuple[int, Any, np.ndarray]:
    """(kind, header, body bytes) of a message `encode` made (the body a view of `buf`)."""
    total, kind, n = _HEAD.unpack_from(buf, 0)
    header = pickle.loads(buf[_HEAD.size:_HEAD.size + n].tobytes())
    start = -(-(_HEAD.size + n) // _ALIGN) * _ALIGN
    return kind, header, buf[start:total]


class Channel:
    """Rank 0's messages to every worker: one broadcast of a fixed-capacity buffer each."""

    def __init__(self, group: Any, capacity: int = INITIAL_CAPACITY) -> None:
        self.group = group
        self._buf = torch.zeros(capacity, dtype=torch.uint8)

    def _broadcast(self) -> None:
        dist.broadcast(self._buf, src=0, group=self.group)

    def send(self, kind: int, header: Any, body: np.ndarray | None = None) -> None:
        msg = encode(kind, header, body)
        if msg.nbytes > self._buf.numel():
            size = max(msg.nbytes, 2 * self._buf.numel())
            resize = encode(RESIZE, size)  # small: fits any capacity
            self._buf.numpy()[:resize.nbytes] = resize
            self._broadcast()
            self._buf = torch.zeros(size, dtype=torch.uint8)
        self._buf.numpy()[:msg.nbytes] = msg
        self._broadcast()

    def recv(self) -> tuple[int, Any, np.ndarray]:
        while True:
            self._broadcast()
            kind, header, body = decode(self._buf.numpy())
            if kind != RESIZE:
                return kind, header, body
            self._buf = torch.zeros(header, dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's address and a port it found free."""

    host: str
    port: int
    world_size: int
    backend: str  # of the default group (the model's collectives): nccl on CUDA, gloo on CPU

    def join(self, rank: int) -> Any:
        """Join the default group, then the message group (gloo); returns the latter."""
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(self.backend, init_method=f"tcp://{self.host}:{self.port}", rank=rank,
                                world_size=self.world_size, timeout=timeout)
        # A worker waits for rank 0's next message as long as the replica idles: that wait has no
        # useful bound (a dead rank 0 closes the sockets, which fails it at once).
        return dist.new_group(backend="gloo", timeout=IDLE_WAIT)


def receive_tokens(num: int, device: torch.device) -> torch.Tensor:
    """A worker's side of `Peers.share_tokens`: rank 0's sampled tokens of the pass just run."""
    tokens = torch.empty(num, dtype=torch.int64, device=device)
    dist.broadcast(tokens, src=0)
    return tokens


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the model's group (every rank calls it, at the same
    point): a decision each rank must take alike, such as another warm-up round."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class WorkerLost(RuntimeError):
    """A tensor-parallel worker died or a collective failed: the replica cannot run a pass, ever
    (`fatal`: the engine loop ends, intake is refused as from a dead engine, health fails, and
    Serve replaces the replica with a new group)."""

    fatal = True


class Peers:
    """Rank 0's side of the group: the message channel to the workers and their liveness.

    `workers` is what started them (`parallel_workers`): `dead()` names a worker that ended, or
    None; `terminate()` ends them all. The first failed message is sticky: the group is broken
    for good, and `check` raises from then on (the replica reports unhealthy and is replaced)."""

    def __init__(self, workers: Any, channel: Channel) -> None:
        self.workers, self.channel = workers, channel
        self.failed: str | None = None
        self.stopped = False

    def check(self) -> None:
        if self.failed is None and (dead := self.workers.dead()) is not None:
            self.failed = dead
        if self.failed is not None:
            raise self._lost()

    def _lost(self) -> WorkerLost:
        return WorkerLost(f"tensor-parallel group broken: {self.failed}")

    def _send(self, kind: int, header: Any, body: np.ndarray | None = None) -> None:
        # No liveness poll here, on the hot path: a dead worker fails the collective itself.
        if self.failed is not None:
            raise self._lost()
        try:
            self.channel.send(kind, header, body)
        except Exception as exc:
            self.failed = f"{KIND_NAMES[kind]} message failed: {type(exc).__name__}: {exc}"
            raise WorkerLost(self.failed) from exc

    def load(self, load_kwargs: dict[str, Any]) -> None:
        """Every worker loads its shard (rank 0 loads its own right after: they meet inside)."""
        self._send(LOAD, load_kwargs)

    def build(self, runner_kwargs: dict[str, Any]) -> None:
        """Every worker builds its model runner (its KV share) with these arguments."""
        self._send(BUILD, runner_kwargs)

    def forward(self, prep: Any, host_bytes: np.ndarray) -> None:
        """Every worker replays this pass's forward (rank 0 runs its own right after): the
        header says where each part of the upload lies (rank 0's own fields dropped)."""
        self._send(PASS, dataclasses.replace(prep, pack=None, logits_plan=None, prompt_spans=[]), host_bytes)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """The pass's sampled tokens to every worker (`receive_tokens`), for their token slots
        (right after the pass's own message, which found the group whole)."""
        try:
            dist.broadcast(tokens, src=0)
        except Exception as exc:
            raise self.broken(exc) from exc

    def broken(self, exc: BaseException) -> WorkerLost:
        """Rank 0's side of a pass failed after the workers got it: the ranks are out of step."""
        if self.failed is None:
            self.failed = f"a pass failed on rank 0: {type(exc).__name__}: {exc}"
        return self._lost()

    def stop(self) -> None:
        """Workers leave their loop and exit; idempotent, and safe on a broken group."""
        if self.stopped:
            return
        self.stopped = True
        if self.failed is None:
            try:
                self._send(STOP, None)
            except WorkerLost:
                pass
        self.workers.terminate(wait=self.failed is None)
        if dist.is_initialized():
            dist.destroy_process_group()
