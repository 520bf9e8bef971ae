"""Load reports to the node's relay as datagrams on a Unix socket, between actor calls.

A Ray actor call costs its caller ~0.3 ms of CPU (the core worker's submit, a future, a reply),
and a replica reports ten times a second while it serves: ~3 ms of its CPU a second in calls
alone (docs/results/http_path.md, "The replica's own process by thread").
The node relay runs on the replica's node (`autoscale.relay`), so its reports need no RPC: the
relay binds a Unix datagram socket and names it in its reply to an actor call; the reporter then
sends each report as one datagram (a few microseconds) and makes an actor call only once a
heartbeat (for the controller's report period, and to learn a restarted relay's new socket) or
when a datagram cannot go (the relay gone or full: the report goes by the call, nothing lost).

A Unix datagram socket queues `net.unix.max_dgram_qlen` datagrams (10 on this machine, 512 on
many distributions) before a sender hears EAGAIN: the relay's event loop reads each as it comes,
and a report that finds the queue full goes by call.

The socket lives in a directory of its own (mode 0700, the socket 0600): only the user Ray runs
as can send, the same trust Ray's own sockets and pickles have.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_PARENT_CHARS = 70  # a parent directory this long still leaves room for ours and the socket's name


def session_sockets_dir() -> str | None:
    """Ray's session directory's `sockets` folder on this node (None outside Ray)."""
    try:
        from ray._private import worker
        path = os.path.join(worker._global_node.get_session_dir_path(), "sockets")
        return path if os.path.isdir(path) else None
    except Exception:  # noqa: BLE001 - not in a Ray worker, or Ray moved it: the temp dir
        return None


class _Intake(asyncio.DatagramProtocol):
    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self.on_message = on_message
        self.received = 0
        self.bad = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            message = pickle.loads(data)
        except Exception:  # noqa: BLE001 - a datagram that is not a report is dropped
            self.bad += 1
            return
        self.received += 1
        try:
            self.on_message(message)
        except Exception:  # noqa: BLE001 - one bad report must not close the intake
            self.bad += 1
            logger.exception("a datagram report failed")


class DatagramIntake:
    """A Unix datagram socket in a directory of its own; each datagram, unpickled, goes to
    `on_message` on the running event loop. `close()` removes the socket and its directory."""

    def __init__(self, path: str, transport: asyncio.DatagramTransport, protocol: _Intake) -> None:
        self.path, self._transport, self._protocol = path, transport, protocol

    @classmethod
    async def open(cls, on_message: Callable[[Any], None], under: str | None = None) -> DatagramIntake:
        """Bound in a new directory under `under` (Ray's session directory, which Ray's own
        sockets share), or the system's temporary directory where `under` is None or too deep
        for a socket's path (108 bytes on Linux)."""
        if under is None or len(under) > MAX_PARENT_CHARS:
            under = None
        directory = tempfile.mkdtemp(prefix="stallfree-relay-", dir=under)  # 0700
        path = os.path.join(directory, "reports.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.setblocking(False)
            transport, protocol = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _Intake(on_message), sock=sock)
        except BaseException:
            sock.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(path, transport, protocol)

    @property
    def received(self) -> int:
        return self._protocol.received

    @property
    def bad(self) -> int:
        return self._protocol.bad

    def close(self) -> None:
        self._transport.close()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


class DatagramSender:
    """Sends pickled messages to one intake's socket; `send` never blocks and never raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, message: Any) -> bool:
        """True once the datagram is in the intake's queue; False when it cannot be (the
        socket gone, its queue full, a message too large): the caller sends it another way."""
        try:
            self._sock.sendto(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), self.path)
            return True
        except (OSError, pickle.PicklingError):
            return False

    def close(self) -> None:
        self._sock.close()
