"""Token-load routing when Ray's HAProxy chooses the engine replica: its server weights, set from
the replicas' token load a few times a second.

Behind HAProxy (serve_config.yaml's path: `ingress_in_replica`, `RAY_SERVE_ENABLE_HA_PROXY`),
HAProxy picks the engine replica of each request itself, by least connections; it reads no body
and asks no one (`ingress_router` makes it ask the app's router per request: opt-in, because under
overload requests waited for their route). Here the engine replicas steer that choice instead,
every `haproxy_weight_interval_ms` (250 by default; null turns it off): they push weights over
their node's HAProxy admin socket (`set weight`), so that least connections becomes least token
load, the router's own measure (`routing.predicted_load`). While a replica's door refuses, the
weights are equal and the doors decide (`weights`). Below saturation this cut TTFT and TBT tails;
at 10x overload it served as many as plain least connections (docs/results/routing.md).

HAProxy's least connections serves the server with the smallest (requests in flight + 1) /
weight. With weight_i proportional to (n_i + 1) / (L_i + c), where n_i is the requests a replica
holds (running and waiting), L_i its token load and c the fleet's mean tokens per request, that
key is (L_i + c) / K at the moment of the push: the replica with the least token load wins. Each
request HAProxy sends it before the next push raises its key by about that replica's own mean
tokens per request, as the router's in-flight ledger would. A replica HAProxy knows and the
controller does not yet (just started) counts as idle. Weights are whole numbers from 1 to 256;
HAProxy reloads reset them, and the next push sets them again.

One replica per node pushes: the one whose server has the smallest name among the servers at
its own address (HAProxy reaches a node's replicas at one address), so a node's HAProxy gets one
writer and the controller one read per node and interval, not one per replica. The others read
HAProxy's servers (a local socket) and stand by; when the pusher goes, the next one takes over.

`weights`, `server_replicas` and `commands` are pure (tested without Ray or HAProxy);
`WeightPusher` is the loop, on an injected snapshot source and socket.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from replicas.protocol import ReplicaLoad
from replicas.scheduling.admission import admits

logger = logging.getLogger(__name__)

MAX_WEIGHT = 256  # HAProxy's largest server weight
REPLICA_SERVER_PREFIX = "SERVE_REPLICA"  # Ray names a replica's server after its actor name
DEFAULT_INTERVAL_MS = 250  # AppArgs.haproxy_weight_interval_ms's default
LOG_EVERY_PUSHES = 240  # the node's pusher logs its counts on its first push and every this many


def server_replicas(servers: Iterable[str], keys: Iterable[str]) -> dict[str, str]:
    """HAProxy server name -> replica key (`app#deployment#id`), for the servers that are these
    replicas. Ray names a replica's server after its actor name, `SERVE_REPLICA::app#deployment#id`
    with the characters HAProxy refuses replaced, so the replica's unique id ends the name."""
    by_id = {key.rpartition("#")[2]: key for key in keys}
    found = {}
    for name in servers:
        if name.startswith(REPLICA_SERVER_PREFIX):
            key = by_id.get(name.rpartition("-")[2])
            if key is not None:
                found[name] = key
    return found


def refuses(load: ReplicaLoad, prompt_tokens: float) -> bool:
    """Whether the replica's door would answer a prompt of `prompt_tokens` with 429 now: its
    queue bound (`queue_bound_tokens`) does not admit it on top of what waits."""
    bound = load.queue_bound_tokens
    return bound is not None and not admits(load.waiting_tokens, math.ceil(prompt_tokens), bound)


def mean_request_tokens(loads: Iterable[ReplicaLoad | None]) -> float:
    """The fleet's mean token load a request (at least 1): what a request adds to its replica."""
    known = [load for load in loads if load is not None]
    requests = sum(load.num_running + load.num_waiting for load in known)
    return max(1.0, sum(load.token_load for load in known) / requests) if requests else 1.0


def doors_refuse(loads: Iterable[ReplicaLoad | None]) -> bool:
    """Whether any replica's door would refuse the fleet's mean waiting prompt now (none waits
    anywhere: no door refuses, an empty queue admits anything)."""
    known = [load for load in loads if load is not None]
    waiting = sum(load.num_waiting for load in known)
    prompt = sum(load.waiting_tokens for load in known) / waiting if waiting else 1.0
    return any(refuses(load, prompt) for load in known)


def weights(loads: Mapping[str, ReplicaLoad | None]) -> dict[str, int]:
    """Each server's weight from its replica's load (None: not reported yet, counted idle), so
    that HAProxy's least connections prefers the least token load (the module's docstring).

    While any replica's door would refuse the fleet's mean waiting prompt, every weight is equal: the
    doors decide there, each over its own queue, and plain least connections sends each replica
    what it answers. Uneven weights would have one door refuse more while another admitted less
    than it could (at 10x overload, two replicas served 14-20% fewer: docs/results/routing.md)."""
    if doors_refuse(loads.values()):
        return {name: MAX_WEIGHT for name in loads}
    per_request = mean_request_tokens(loads.values())

    def share(load: ReplicaLoad | None) -> float:
        if load is None:
            return 1.0 / per_request
        return (load.num_running + load.num_waiting + 1) / (load.token_load + per_request)

    shares = {name: share(load) for name, load in loads.items()}
    top = max(shares.values(), default=0.0)
    return {name: max(1, min(MAX_WEIGHT, round(MAX_WEIGHT * s / top))) for name, s in shares.items()}


@dataclass
class Server:
    backend: str
    name: str
    weight: int
    address: str = ""


def parse_servers_state(text: str) -> list[Server]:
    """`show servers state`'s lines (version line and `#` header skipped): backend, server, the
    weight it has now (`srv_uweight`) and its address."""
    servers = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8 or line.startswith("#"):
            continue
        try:
            servers.append(Server(fields[1], fields[3], int(fields[7]), fields[4]))
        except ValueError:
            continue
    return servers


def pushes_here(servers: list[Server], me: str | None) -> bool:
    """Whether replica `me` (its key; None: no election, always) is its node's pusher: its server
    has the smallest name among the replica servers at its address."""
    if me is None:
        return True
    found = server_replicas((s.name for s in servers), [me])
    mine = [s for s in servers if s.name in found]
    if not mine:  # HAProxy does not know it yet
        return False
    local = [s.name for s in servers if s.address == mine[0].address and s.name.startswith(REPLICA_SERVER_PREFIX)]
    return mine[0].name == min(local)


def commands(servers: list[Server], loads: Mapping[str, ReplicaLoad]) -> tuple[list[str], dict[str, int]]:
    """The `set weight` commands for every backend that serves these replicas and has more than
    one replica server (one has nothing to choose), only where a weight changes; and the weights
    of those servers (name -> weight) as they will be."""
    by_backend: dict[str, list[Server]] = {}
    for server in servers:
        if server.name.startswith(REPLICA_SERVER_PREFIX):
            by_backend.setdefault(server.backend, []).append(server)
    out, now = [], {}
    for backend, members in by_backend.items():
        mapped = server_replicas((s.name for s in members), loads)
        if not mapped or len(members) < 2:
            continue
        wanted = weights({s.name: loads.get(mapped[s.name]) if s.name in mapped else None for s in members})
        for server in members:
            now[server.name] = wanted[server.name]
            if wanted[server.name] != server.weight:
                out.append(f"set weight {backend}/{server.name} {wanted[server.name]}")
    return out, now


@dataclass
class WeightPusher:
    """Every `interval_s`: HAProxy's servers (`send("show servers state")`); on the node's pusher
    (`pushes_here` for replica `me`), the replicas' loads (`fetch`) and the weights that changed,
    in one `send`. A failed step (controller or socket away) is counted and logged now and then,
    never raised."""

    fetch: Callable[[], Awaitable[Mapping[str, ReplicaLoad]]]
    send: Callable[[str], Awaitable[str]]
    interval_s: float = DEFAULT_INTERVAL_MS / 1000
    me: str | None = None
    num_steps: int = 0
    num_changes: int = 0
    num_failures: int = 0
    num_doors_refusing: int = 0  # pushes made while a door refused (equal weights)
    pushing: bool = False  # this replica is its node's pusher (at the last step)
    last_error: str | None = None  # the last step's failure; None once a step succeeds
    last: dict[str, int] = field(default_factory=dict)  # server -> weight after the last step

    async def step(self) -> int:
        """One push; returns how many weights it changed (0 too where another replica pushes)."""
        servers = parse_servers_state(await self.send("show servers state"))
        self.pushing, self.last_error = pushes_here(servers, self.me), None
        if not self.pushing:
            return 0
        loads = await self.fetch()
        cmds, now = commands(servers, loads)
        self.num_doors_refusing += doors_refuse(loads.values())
        if cmds:
            await self.send(";".join(cmds))
        self.last = now
        self.num_steps += 1
        self.num_changes += len(cmds)
        if self.num_steps % LOG_EVERY_PUSHES == 1:
            logger.info("HAProxy weights: %d pushes, %d weights changed, %d pushes while a door refused; "
                        "now %s", self.num_steps, self.num_changes, self.num_doors_refusing, now)
        return len(cmds)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep pushing; HAProxy keeps its last weights
                self.num_failures += 1
                self.last_error = repr(exc)
                if self.num_failures == 1 or self.num_failures % 100 == 0:
                    logger.warning("HAProxy weights: a push failed (%d times): %r", self.num_failures, exc)
            await asyncio.sleep(self.interval_s)

    def state(self) -> dict[str, Any]:
        """What /health shows: the interval, whether this replica pushes for its node, pushes and
        changes so far, the pushes made while a door refused (equal weights then), failures (and
        the last step's, if it failed), and the last push's weights. Failures come with HAProxy's
        reloads (a replica added or gone) and stop after them."""
        return {"interval_ms": round(1000 * self.interval_s), "pushing": self.pushing, "pushes": self.num_steps,
                "changes": self.num_changes, "doors_refusing": self.num_doors_refusing,
                "failures": self.num_failures, "last_error": self.last_error, "weights": self.last}


def admin_socket(path: str, timeout_s: float = 1.0) -> Callable[[str], Awaitable[str]]:
    """`send(command)`: one command line (several joined by `;`) to HAProxy's admin socket at
    `path`, its whole answer back (HAProxy closes the connection after answering)."""

    async def send(command: str) -> str:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout_s)
        try:
            writer.write(command.encode() + b"\n")
            await writer.drain()
            return (await asyncio.wait_for(reader.read(), timeout_s)).decode(errors="replace")
        finally:
            writer.close()

    return send


def node_admin_socket_path() -> str:
    """This node's HAProxy admin socket as Ray's HAProxy manager lays it out: the configured path
    (`RAY_SERVE_HAPROXY_SOCKET_PATH`) with the node's id as its last directory."""
    import ray
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH

    directory, name = os.path.split(RAY_SERVE_HAPROXY_SOCKET_PATH)
    return os.path.join(directory, ray.get_runtime_context().get_node_id(), name)
