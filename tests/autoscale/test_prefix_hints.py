"""The router remembers where it sent a prompt's prefix at a few marks, so a conversation's next
turn and a shared system prompt find that replica with O(blocks / 16) lookups; the table is
bounded, oldest out."""

from __future__ import annotations

import pytest

from autoscale.prefix_hints import PrefixHints, kept, marks
from replicas.scheduling.prefix_hash import block_hashes

pytestmark = pytest.mark.unit


def test_marks_are_the_first_powers_of_two_every_16th_and_the_last():
    assert marks(0) == []
    assert marks(1) == [0]
    assert marks(5) == [0, 1, 3, 4]
    assert marks(40) == [0, 1, 3, 7, 15, 31, 39]
    assert marks(32) == [0, 1, 3, 7, 15, 31]
    # What a record keeps: about two entries of its own, however long the prompt.
    assert kept(0) == [] and kept(1) == [0] and kept(5) == [0, 1, 3, 4]
    assert kept(40) == [0, 1, 3, 7, 31, 39] and kept(32) == [0, 1, 3, 7, 31]
    assert kept(1000) == [0, 1, 3, 7, 991, 999]


def test_next_turn_finds_the_replica_of_the_previous_turn():
    hints = PrefixHints(1000)
    turn1 = list(range(1000, 1000 + 16 * 37))  # 37 blocks
    hints.record(block_hashes(turn1, 16), "a")
    hints.record(block_hashes(list(range(5000, 5400)), 16), "b")
    turn2 = turn1 + list(range(9000, 9000 + 16 * 10))
    assert hints.lookup(block_hashes(turn2, 16)) == "a"
    assert hints.lookup(block_hashes(list(range(7000, 7400)), 16)) is None
    assert hints.lookup([]) is None


def test_a_shared_system_prompt_finds_a_replica_that_was_sent_it():
    hints = PrefixHints(1000)
    system = list(range(64 * 16))  # 64 blocks
    hints.record(block_hashes(system + list(range(90_000, 90_100)), 16), "a")
    other_user = system + list(range(70_000, 70_300))
    assert hints.lookup(block_hashes(other_user, 16)) == "a"  # block 63 is a mark (every 16th)
    hints.record(block_hashes(other_user, 16), "b")  # keeps b at its own deepest 16th (block 79)
    assert hints.lookup(block_hashes(system + [1, 2, 3] * 100, 16)) == "a"


def test_the_table_is_bounded_oldest_out_and_zero_is_off():
    hints = PrefixHints(10)
    prompts = [list(range(i * 10_000, i * 10_000 + 16 * 4)) for i in range(6)]  # 4 blocks: 3 kept each
    for i, p in enumerate(prompts):
        hints.record(block_hashes(p, 16), f"r{i}")
    assert len(hints) == 10
    assert hints.lookup(block_hashes(prompts[0], 16)) is None
    assert hints.lookup(block_hashes(prompts[5], 16)) == "r5"
    off = PrefixHints(0)
    off.record(block_hashes(prompts[0], 16), "a")
    assert len(off) == 0 and off.lookup(block_hashes(prompts[0], 16)) is None
