"""Memory goes back to the system once per idle spell after a busy one, never while requests are in
flight, and never twice for one spell."""

from __future__ import annotations

import asyncio

import pytest

from app.memory import IdleTrim, _malloc_trim, trim_when_idle

pytestmark = pytest.mark.unit


def test_trims_once_per_idle_spell_after_busy() -> None:
    calls: list[int] = []
    trimmer = IdleTrim(lambda pad: calls.append(pad) or 1)
    assert not trimmer.step(idle=True)  # idle from the start: nothing to give back
    assert not trimmer.step(idle=False)  # busy: never while in flight
    assert not trimmer.step(idle=False)
    assert trimmer.step(idle=True) and calls == [0]  # the first idle check after busy
    assert not trimmer.step(idle=True) and calls == [0]  # the same spell: once
    trimmer.step(idle=False)
    assert trimmer.step(idle=True) and calls == [0, 0] and trimmer.num_trims == 2


def test_glibc_trim_is_found_here() -> None:
    trim = _malloc_trim()
    assert trim is not None and trim(0) in (0, 1)


async def test_the_loop_checks_the_idle_signal() -> None:
    states = iter([False, True, True])
    calls: list[int] = []
    trimmer = IdleTrim(lambda pad: calls.append(pad) or 1)
    task = asyncio.get_running_loop().create_task(
        trim_when_idle(lambda: next(states, True), every_s=0.001, trimmer=trimmer))
    for _ in range(500):
        if trimmer.num_trims:
            break
        await asyncio.sleep(0.001)
    task.cancel()
    assert trimmer.num_trims == 1 and calls == [0]
