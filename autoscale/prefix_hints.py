"""`PrefixHints`: where a router sent prompt prefixes lately, so prefix routing asks a few
replicas' sketches instead of every replica's.

A prompt's block hashes are chained (hash i names blocks 0..i), so one hash names a whole
prefix. The marks of a prompt are blocks 1, 2, 4, 8, then every 16th, and the last. `record`
keeps the hashes at the first four marks, the deepest 16th and the last, mapped to the replica
chosen (a conversation adds about two entries a turn, whatever its length); `lookup` walks a new
prompt's marks from the deepest and returns the replica of the first one remembered. A
conversation's next turn finds the replica of its previous turn (its deepest 16th block is a
mark of the longer prompt too); a shared system prompt finds a replica that was sent it (to 8
blocks; the sample usually holds the rest). A lookup costs O(blocks / 16) dictionary reads.
The table is bounded, least recently recorded first out. The replica's sketch still decides the hit:
a hint only adds a replica to the ones looked at. Plain Python, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

STRIDE = 16  # blocks between marks past the first few


def marks(num_blocks: int) -> list[int]:
    """Indices of a prompt's block hashes that the hints keep and look up, shallowest first."""
    out = [i for i in (0, 1, 3, 7) if i < num_blocks] + list(range(STRIDE - 1, num_blocks, STRIDE))
    if out and out[-1] != num_blocks - 1:
        out.append(num_blocks - 1)
    return out


def kept(num_blocks: int) -> list[int]:
    """The marks `record` keeps: the first four, the deepest 16th and the last."""
    if num_blocks == 0:
        return []
    deepest = (num_blocks // STRIDE) * STRIDE - 1
    return list(dict.fromkeys([i for i in (0, 1, 3, 7) if i < num_blocks] + [deepest] * (deepest >= 0)
                              + [num_blocks - 1]))


class PrefixHints:
    """Block hash -> the replica a prompt with that prefix was sent to, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._where)

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """A prompt with these block hashes was sent to `replica`."""
        if self.capacity <= 0:
            return
        for i in kept(len(hashes)):
            self._where.pop(hashes[i], None)  # re-inserted: it becomes the most recent
            self._where[hashes[i]] = replica
        while len(self._where) > self.capacity:
            del self._where[next(iter(self._where))]

    def lookup(self, hashes: Sequence[int]) -> str | None:
        """The replica last sent the longest remembered prefix of this prompt, if any."""
        for i in reversed(marks(len(hashes))):
            replica = self._where.get(hashes[i])
            if replica is not None:
                return replica
        return None
