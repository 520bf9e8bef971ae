"""Paged KV block manager: fixed-size blocks, per-request block tables, never over-commits.

It only does the bookkeeping; the KV tensors live in the model runner and are addressed by
the slot numbers this manager hands out (slot = block * block_size + offset).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Allocates KV blocks to requests. Invariant: num_used + num_free == num_blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must gain so its table covers `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(request_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover `num_tokens`; all or nothing."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # already covered: most decode steps
        need = self.num_new_blocks(request_id, num_tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._free.popleft())
        return True

    def free(self, request_id: str) -> int:
        """Return every block of the request to the pool; returns how many."""
        table = self._tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end)."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
