"""Block hashes of a token sequence and a compact sketch of a replica's cached blocks.

A full KV block is named by the hash of (its parent block's hash, its token ids, an optional
key for anything else that changes the KV, e.g. a model or adapter): equal hashes mean equal
prefixes, so a block can be shared by every request whose prompt starts the same way (vLLM's
automatic prefix caching). The replica's `BlockManager`, the router and the simulator all call
`block_hashes`, so they name blocks alike. Light on purpose (hashlib only): the router and the
ingress import it.

`PrefixSketch` is what a replica reports of its cache: a Bloom filter over its cached block
hashes, a fixed number of bits whatever the cache holds, so the load report stays small. The
router asks it how many leading blocks of a prompt a replica holds; a false positive (rare at
the default 16 bits a block) only makes the router overestimate one replica's hit. The replica
keeps it as counts (`SketchCounts`, updated as blocks are registered and reclaimed), so a report
costs one vectorized pack, not a walk over every cached hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

HASH_BYTES = 16  # 128-bit block hashes: a collision (a wrong KV block reused) is out of reach
SKETCH_BITS_PER_BLOCK = 16
SKETCH_HASHES = 3  # bit positions per block in the Bloom filter (~0.4% false positives at 16 bits)


def block_hash(parent: int | None, tokens: Sequence[int], extra_key: bytes = b"") -> int:
    """The hash naming a full block of `tokens` that follows the block hashed `parent`."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, key=extra_key[:64])
    h.update((parent or 0).to_bytes(HASH_BYTES, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, *, parent: int | None = None,
                 extra_key: bytes = b"") -> list[int]:
    """Hashes of the full blocks of `token_ids` (`parent`: the hash of the block before the
    first, None at a sequence's start)."""
    out: list[int] = []
    for b in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size:(b + 1) * block_size], extra_key)
        out.append(parent)
    return out


def sketch_bits(capacity_blocks: int) -> int:
    """Bits of the sketch of a cache of `capacity_blocks` blocks (a whole number of bytes)."""
    return 8 * max(8, -(-SKETCH_BITS_PER_BLOCK * capacity_blocks // 8))


def _positions(h: int, num_bits: int) -> Iterable[int]:
    for i in range(SKETCH_HASHES):  # disjoint 40-bit slices of the 128-bit hash
        yield (h >> (40 * i)) % num_bits


@dataclass(frozen=True)
class PrefixSketch:
    """A Bloom filter over block hashes: `bits`, a bit set of `num_bits` bits."""

    num_bits: int
    bits: bytes

    @classmethod
    def of(cls, hashes: Iterable[int], capacity_blocks: int) -> PrefixSketch:
        """A sketch sized for `capacity_blocks` blocks holding `hashes`."""
        num_bits = sketch_bits(capacity_blocks)
        bits = bytearray(num_bits // 8)
        for h in hashes:
            for p in _positions(h, num_bits):
                bits[p >> 3] |= 1 << (p & 7)
        return cls(num_bits, bytes(bits))

    def __contains__(self, h: int) -> bool:
        return all(self.bits[p >> 3] >> (p & 7) & 1 for p in _positions(h, self.num_bits))

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `block_hashes`) the sketch holds."""
        n = 0
        for h in hashes:
            if h not in self:
                break
            n += 1
        return n


class SketchCounts:
    """A counting Bloom filter: how many cached hashes set each bit, kept as blocks come and go,
    packed into a `PrefixSketch` on demand (the bits whose count is not zero)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.num_bits = sketch_bits(capacity_blocks)
        self._counts = np.zeros(self.num_bits, dtype=np.int32)

    def add(self, h: int) -> None:
        for p in _positions(h, self.num_bits):
            self._counts[p] += 1

    def remove(self, h: int) -> None:
        for p in _positions(h, self.num_bits):
            self._counts[p] -= 1

    def sketch(self) -> PrefixSketch:
        return PrefixSketch(self.num_bits, np.packbits(self._counts > 0, bitorder="little").tobytes())
