"""A tensor-parallel group's workers: where they run, how they start, and their loop.

Inside a Serve replica the workers are Ray actors in the replica's own placement group (worker i
on bundle i: Serve reserves `[{CPU: n, GPU: 1}] + [{GPU: 1}] x (tp-1)`, STRICT_PACK on GPU hosts,
see `app.builder`), as Ray Serve LLM places vLLM's. Elsewhere (`python -m replicas`, tests) they
are processes on this host, forked from a server process that has imported this module and
nothing else (multiprocessing's forkserver): a worker starts in ~0.1 s instead of ~5 s of torch
and transformers imports, and never inherits a torch that has run (whose thread pools a fork may
hang in) or touched CUDA; each takes this process's environment of the moment, as a spawned one
would. Either way they meet rank 0 at its node's address on a port it found free, and then run
`worker_loop`: load a shard, build a runner, replay passes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from replicas.execution.model_runner import ModelRunner
from replicas.execution.parallel import BUILD, LOAD, PASS, STOP, Channel, Peers, Rendezvous, backend_for
from replicas.loading.models import load_model, resolve_device
from replicas.scheduling.kv_cache import BlockManager

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 10.0  # a worker's exit, after the stop message


def worker_loop(rank: int, rendezvous: Rendezvous, threads: int | None, local_rank: int = 0,
                environ: dict[str, str] | None = None) -> None:
    """A worker's life: join the group, then obey rank 0's messages until it says stop. `environ`:
    the environment to take first (a forked worker's is its server's, from that one's start)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ["LOCAL_RANK"] = str(local_rank)  # transformers binds the rank's device by it
    if threads:
        torch.set_num_threads(threads)
    channel = Channel(rendezvous.join(rank))
    model = runner = None
    try:
        while True:
            kind, header, body = channel.recv()
            if kind == PASS:
                runner.replay(header, body)
            elif kind == LOAD:
                model = runner = None
                device = header["device"]
                if resolve_device(device) == "cuda":
                    device = f"cuda:{local_rank}"
                model, _ = load_model(**{**header, "device": device})
            elif kind == BUILD:
                kwargs = dict(header)
                blocks = BlockManager(kwargs.pop("num_blocks"), kwargs.pop("block_size"))
                runner = ModelRunner(model, blocks, **kwargs)
            elif kind == STOP:
                return
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_context() -> multiprocessing.context.BaseContext:
    """Forkserver, its server preloaded with this module (so with torch and transformers): the
    first group of a process pays the imports once, every later worker is a fork of that server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class LocalWorkers:
    """Workers as processes of this host (`worker_context`: never a fork of a torch that has run)."""

    def __init__(self, rendezvous: Rendezvous, threads: int | None) -> None:
        ctx = worker_context()
        # This process's environment now, as a spawned worker had it (the model cache, the devices
        # it may see: CUDA is not touched before the worker's own first use).
        environ = dict(os.environ)
        self.procs = [ctx.Process(target=worker_loop, args=(rank, rendezvous, threads, rank, environ), daemon=True,
                                  name=f"tp-worker-{rank}") for rank in range(1, rendezvous.world_size)]
        for p in self.procs:
            p.start()

    def dead(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def terminate(self, wait: bool = True) -> None:
        for p in self.procs:
            p.join(JOIN_TIMEOUT_S if wait else 0)
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)

    def kill(self, rank: int) -> None:
        """End one worker at once (fault tests)."""
        self.procs[rank - 1].kill()


class _RayWorker:
    """A worker as a Ray actor: `run` is its whole life (it returns when told to stop)."""

    def run(self, rank: int, rendezvous: Rendezvous, threads: int | None) -> None:
        worker_loop(rank, rendezvous, threads)


class RayWorkers:
    """Workers as Ray actors, worker i on bundle i of the calling replica's placement group."""

    def __init__(self, rendezvous: Rendezvous, threads: int | None, placement_group: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(_RayWorker)
        self.actors, self.runs = [], []
        for rank in range(1, rendezvous.world_size):
            if rank >= len(placement_group.bundle_specs):
                raise ValueError(f"tensor_parallel_size {rendezvous.world_size} needs a placement group "
                                 f"bundle per rank; the replica's group has {len(placement_group.bundle_specs)}")
            bundle = placement_group.bundle_specs[rank]  # the worker takes its whole bundle
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                        placement_group_bundle_index=rank)
            a = actor.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                              scheduling_strategy=strategy, max_restarts=0).remote()
            self.actors.append(a)
            self.runs.append(a.run.remote(rank, rendezvous, threads))

    def dead(self) -> str | None:
        import ray

        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in ready:
            rank = self.runs.index(ref) + 1
            try:
                ray.get(ref)
                return f"worker rank {rank} left its loop"
            except Exception as exc:  # noqa: BLE001 - the actor died or its loop raised
                cause = getattr(exc, "cause", None) or exc  # a RayTaskError wraps the loop's own
                return f"worker rank {rank} died: {type(cause).__name__}: {str(cause)[-300:]}"
        return None

    def terminate(self, wait: bool = True) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.wait(self.runs, num_returns=len(self.runs), timeout=JOIN_TIMEOUT_S if wait else 0)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)


def _placement_group() -> Any:
    """The calling replica's placement group under Ray (Serve gives one with bundles), or None."""
    try:
        import ray
        from ray.util import get_current_placement_group

        return get_current_placement_group() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray
        return None


def start_group(tensor_parallel_size: int, device: str, threads: int | None) -> Peers:
    """Start the workers and join the group as rank 0 (returns once every rank has joined)."""
    device = resolve_device(device)
    group = _placement_group()
    if group is not None:
        import ray

        host = ray.util.get_node_ip_address()
    else:
        host = "127.0.0.1"
    rendezvous = Rendezvous(host, free_port(host), tensor_parallel_size, backend_for(device))
    if group is not None:
        workers: LocalWorkers | RayWorkers = RayWorkers(rendezvous, threads, group)
    else:
        workers = LocalWorkers(rendezvous, threads)
    try:
        channel = Channel(rendezvous.join(0))
    except Exception:
        workers.terminate()
        raise
    log.info("tensor-parallel group of %d joined at %s:%d (%s)", tensor_parallel_size, rendezvous.host,
             rendezvous.port, rendezvous.backend)
    return Peers(workers, channel)
