"""Paged KV block manager: fixed-size blocks, per-request block tables, never over-commits,
and (with `enable_caching`) a prefix cache of full blocks shared by reference.

It only does the bookkeeping; the KV tensors live in the model runner and are addressed by
the slot numbers this manager hands out (slot = block * block_size + offset).

Prefix caching (vLLM's automatic prefix caching). A full block whose KV has been computed is
registered under its hash (`prefix_hash.block_hash`: parent hash + token ids), so a later
request whose tokens start the same way takes a reference to it instead of recomputing it.
Blocks are reference-counted. A block nobody references stays cached ("cached-free") and is
reclaimed only when a new block is needed and no plain free block is left: least recently freed
first, and a request's blocks are freed last block first, so a shared prefix outlives its tails.

Invariant (`check()`): used + cached-free + free == total; a block is referenced (refcount > 0)
or in the free pool, never both; a hash names at most one block; only cached blocks are shared
(a prefix is blocks `cached_prefix` found).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from replicas.scheduling.prefix_hash import PrefixSketch, SketchCounts, block_hashes

if TYPE_CHECKING:
    from replicas.request import Request


class BlockManager:
    """Allocates KV blocks to requests and shares cached prefix blocks between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 extra_key: bytes = b"") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key  # whatever else changes the KV (model, adapter)
        # The free pool, in reuse order: plain free blocks first (a stack: the next one is last,
        # so a request's blocks are taken and given back in bulk), then cached-free ones from the
        # least recently freed (an ordered set). A block in the pool never changes kind.
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[int, int] = {}  # block hash -> block
        self._hash_of: dict[int, int] = {}  # block -> its hash, for registered blocks
        self._registered: dict[str, int] = {}  # request -> leading blocks looked at for registering
        # Counters for metrics (tokens) and the report's sketch.
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.version = 0  # bumped whenever the set of cached hashes changes
        self._counts = SketchCounts(num_blocks) if enable_caching else None
        self._sketch: tuple[int, PrefixSketch] | None = None

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: plain free and cached-free (reclaimable)."""
        return len(self._plain) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached over prompt tokens looked up, since start."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----------------------------------------------------------------------

    def num_new_blocks(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Free blocks a request takes so its table covers `num_tokens` tokens (with `prefix`:
        a table starting with those cached blocks, the idle ones among them counted as taken)."""
        have = len(self._tables.get(request_id, ())) or len(prefix)
        new = max(0, self.blocks_for(num_tokens) - have)
        return new + self.num_idle(prefix) if prefix else new

    def num_idle(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody references (taking them shrinks the free pool)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: int = 0,
                     prefix: Sequence[int] = ()) -> bool:
        return self.num_new_blocks(request_id, num_tokens, prefix) + reserve <= self.num_free

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Grow the request's table to cover `num_tokens`; all or nothing. `prefix` (cached
        blocks from `cached_prefix`, for a request with no table yet) starts the table."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # already covered: most decode steps
        if self.num_new_blocks(request_id, num_tokens, () if table else prefix) > self.num_free:
            return False
        if table is None:
            table = self._tables[request_id] = []
            for b in prefix:
                self._ref(b)
                table.append(b)
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            self._take(table, need)
        return True

    def append_blocks(self, request_ids: Sequence[str]) -> bool:
        """One more block at the end of each request's table, in order (decodes that crossed a
        block boundary: what `allocate` gives each of them); all or nothing."""
        if len(request_ids) > self.num_free:
            return False
        tables, plain, refs = self._tables, self._plain, self._refs
        for rid in request_ids:
            if plain:
                b = plain.pop()
                refs[b] = 1
                tables[rid].append(b)
            else:
                self._take(tables[rid], 1)
        return True

    def free(self, request_id: str) -> int:
        """Drop every reference the request holds; returns how many blocks it held. Blocks
        whose last reference goes return to the pool (cached ones stay findable)."""
        table = self._tables.pop(request_id, [])
        self._registered.pop(request_id, None)
        refs, hash_of, plain, cached_free = self._refs, self._hash_of, self._plain, self._cached_free
        if not hash_of:  # nothing cached, so nothing shared: every block goes back, the first on top
            for b in table:
                refs[b] = 0
            plain += reversed(table)
            return len(table)
        for b in reversed(table):  # tail first: the shared prefix is reclaimed last
            left = refs[b] - 1
            refs[b] = left
            if left == 0:
                if b in hash_of:
                    cached_free[b] = None  # cached: reclaimed after every plain block, oldest first
                else:
                    plain.append(b)  # nothing cached: reused first
        return len(table)

    def reserve(self) -> int:
        """Take the last block out of circulation for good and return it: the model runner's
        scratch block (the padding rows of a captured decode pass write their k/v there). It
        leaves the pool and the count, so every figure (free, used, capacity) stays exact and
        no request can ever be given it. Only before anything is allocated."""
        if self._tables or self.num_blocks < 2:
            raise RuntimeError("reserve a block before any allocation, and leave at least one")
        block = self.num_blocks - 1
        self._plain.remove(block)
        self._refs.pop()
        self.num_blocks -= 1
        return block

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end)."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            if block in self._cached_free:
                del self._cached_free[block]
            else:
                self._plain.remove(block)
        self._refs[block] += 1

    def _take(self, table: list[int], count: int) -> None:
        """Append `count` blocks from the pool (the caller checked there are) to `table`, in
        reuse order: plain free blocks at once, then cached-free ones reclaimed one by one."""
        plain, refs = self._plain, self._refs
        k = min(count, len(plain))
        if k:
            taken = plain[-k:]
            del plain[-k:]
            taken.reverse()
            for b in taken:
                refs[b] = 1
            table += taken
        for _ in range(count - k):  # reclaim cached-free blocks, least recently freed first
            block, _ = self._cached_free.popitem(last=False)
            h = self._hash_of.pop(block)
            del self._cached[h]
            self._counts.remove(h)
            self.evictions += 1
            self.version += 1
            refs[block] = 1
            table.append(block)

    # ---- the prefix cache ------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding the request's leading tokens, at most all but its last
        token (that one always runs, so the pass samples). Empty when caching is off, and for a
        request asking for prompt logprobs (its prompt rows must run, as vLLM does)."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        return self._leading(self._hashes(request, usable)[:usable])

    def num_cached_leading(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached now (the exact view a sketch
        approximates; the simulator's prefix router reads it)."""
        return len(self._leading(hashes))

    def _leading(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the leading `hashes`, up to the first one not cached."""
        blocks: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request was admitted: `num_tokens` looked up, `num_hit_tokens` of them cached."""
        if self.enable_caching:
            self.query_tokens += num_tokens
            self.hit_tokens += num_hit_tokens

    def cache_computed(self, request: Request, computed: int | None = None) -> None:
        """Register the request's full blocks whose KV is now computed (after a pass): its first
        `computed` tokens (None: `num_computed_tokens`; less while a later pass is in flight)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        computed = request.num_computed_tokens if computed is None else computed
        full = min(computed // self.block_size, len(self._tables.get(rid, ())))
        done = self._registered.get(rid, 0)
        if full <= done:
            return
        table, hashes = self._tables[rid], self._hashes(request, full)
        for i in range(done, full):
            h = hashes[i]
            if h not in self._cached and table[i] not in self._hash_of:
                self._cached[h] = table[i]
                self._hash_of[table[i]] = h
                self._counts.add(h)
                self.version += 1
        self._registered[rid] = full

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's block hashes, at least its first `num_blocks`, computed once and kept on it."""
        hashes, bs = request.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            hashes += block_hashes(request.token_slice(len(hashes) * bs, num_blocks * bs), bs,
                                   parent=hashes[-1] if hashes else None, extra_key=self.extra_key)
        return hashes

    def sketch(self) -> PrefixSketch | None:
        """A Bloom filter of the cached hashes for the load report (packed only on change)."""
        if self._counts is None:
            return None
        if self._sketch is None or self._sketch[0] != self.version:
            self._sketch = (self.version, self._counts.sketch())
        return self._sketch[1]

    def check(self) -> None:
        """Assert the allocator's invariant (tests call it after every operation)."""
        referenced = {b for table in self._tables.values() for b in table}
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                counts[b] += 1
        assert counts == self._refs, "refcounts match the tables"
        assert all(r >= 0 for r in self._refs), "refcounts are never negative"
        free = set(self._plain) | self._cached_free.keys()
        assert len(free) == self.num_free, "a block is in the pool once"
        assert not referenced & free, "no block is both free and referenced"
        assert len(referenced) + len(free) == self.num_blocks, "used + free == total"
        used = sum(1 for r in self._refs if r > 0)
        cached_free = sum(1 for b in free if b in self._hash_of)
        plain_free = sum(1 for b in free if b not in self._hash_of)
        assert cached_free == len(self._cached_free), "the pool's plain blocks are uncached, the others cached"
        assert all(self._refs[b] == 0 for b in free), "free blocks have no reference"
        assert all(b in self._hash_of for b, r in enumerate(self._refs) if r > 1), "only cached blocks are shared"
        assert used + cached_free + plain_free == self.num_blocks, "used + cached-free + free == total"
        assert {b: h for h, b in self._cached.items()} == self._hash_of, "one block per hash"
