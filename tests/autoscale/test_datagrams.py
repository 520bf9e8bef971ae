"""Load reports to the node relay as datagrams: the intake's socket is the user's alone, every
datagram sent arrives once as what was sent, a datagram that is not a report is dropped and
counted, and a sender whose intake is gone says so (its report then goes by actor call)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from typing import Any

import pytest

from autoscale.datagrams import MAX_PARENT_CHARS, DatagramIntake, DatagramSender
from replicas.protocol import ReplicaLoad
from replicas.scheduling.histogram import LogHistogram

pytestmark = pytest.mark.unit


def test_reports_arrive_as_sent_and_a_gone_intake_refuses(await_until: Any) -> None:
    parent = tempfile.mkdtemp()  # short: pytest's tmp_path is too deep for a socket's path

    async def main() -> None:
        got: list[Any] = []
        intake = await DatagramIntake.open(got.append, parent)
        try:
            assert os.path.dirname(os.path.dirname(intake.path)) == parent
            assert stat.S_IMODE(os.stat(os.path.dirname(intake.path)).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(intake.path).st_mode) == 0o600
            sender = DatagramSender(intake.path)
            loads = [ReplicaLoad(replica_id="r", running_tokens=i, tbt_histogram=LogHistogram.of([0.01 * (i + 1)]),
                                 timestamp=float(i)) for i in range(50)]
            for i in range(0, 50, 5):  # a Unix datagram socket may queue as few as 10
                assert all(sender.send(("r", load)) for load in loads[i:i + 5])
                await await_until(lambda i=i: len(got) == i + 5, interval_s=0.01, what=f"{i + 5} reports")
            assert got == [("r", load) for load in loads]
            sender._sock.sendto(b"not a pickle", intake.path)
            await await_until(lambda: intake.bad == 1, interval_s=0.01, what="the bad datagram counted")
            assert intake.received == 50 and len(got) == 50
        finally:
            intake.close()
        assert not os.path.exists(os.path.dirname(intake.path))
        assert not sender.send(("r", loads[0]))  # gone: the caller goes by call
        sender.close()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(parent)


def test_a_parent_too_deep_for_a_sockets_path_falls_back_to_the_temp_dir(tmp_path: Any) -> None:
    deep = tmp_path / ("d" * (MAX_PARENT_CHARS + 1))
    deep.mkdir()

    async def main() -> str:
        intake = await DatagramIntake.open(lambda m: None, str(deep))
        intake.close()
        return intake.path

    assert not asyncio.run(main()).startswith(str(deep))
