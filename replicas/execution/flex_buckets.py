"""The decodes of a compiled flex pass at static shapes: batch-size buckets, and the padded
call per bucket that lets inductor lower them to flex's decoding kernel."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from replicas.execution.attention_flex import decode_block_mask, decode_lists
from replicas.execution.transfer import HostPack, Part


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes compiled for decodes: powers of two below max_num_seqs, then max_num_seqs
    itself (so every count of decodes has one)."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def choose_bucket(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows; None when n is beyond the largest."""
    return next((b for b in buckets if b >= n), None)


class DecodeBuckets:
    """The decodes of a compiled pass at static shapes, as flex lowers them to its decoding kernel
    (GQA heads packed, one KV read per KV head, split-KV by batch x heads): inductor takes that
    kernel only for a static batch, so the decode call of a mixed pass, compiled dynamic in its
    rows, ran the main kernel (a 128-row query tile for each one-row entry, the KV read once per
    query head). Here the entries are padded to a bucket of rows, each bucket a compiled call of
    its own (a code object each: no shared recompile limit), and the page lists sit in a
    persistent buffer as wide as the longest context (the kernel reads only the counted pages),
    so neither rows nor widths make new shapes. Padding entries count no pages (their output is
    dropped)."""

    def __init__(self, buckets: list[int], max_width: int, pad_row: int, device: torch.device,
                 compile_one) -> None:
        self.buckets, self.pad_row = buckets, pad_row
        self.fns = {b: compile_one() for b in buckets}
        self.kv_idx = torch.zeros((buckets[-1], max_width), dtype=torch.int32, device=device)

    def plan(self, table: np.ndarray, rows, lens, pos, block_size: int, pack: HostPack) -> dict[str, Part] | None:
        """Host side: the padded counts, rows and positions, and the real entries' page lists;
        None when the decodes outnumber the largest bucket (the dynamic call takes them)."""
        n = len(rows)
        bucket = choose_bucket(n, self.buckets)
        if bucket is None:
            return None
        lists = decode_lists(table, rows, lens, block_size, full_blocks=False)
        padded = np.zeros((3, bucket), dtype=np.int64)  # pages, runner rows, positions
        padded[0, :n] = lists["kv_num"]
        padded[1, :n], padded[1, n:] = rows, self.pad_row
        padded[2, :n] = pos
        return {"padded": pack.add(padded), "kv_idx": pack.add(lists["kv_idx"])}

    def metadata(self, parts: dict[str, Part], pack: HostPack, page_map: torch.Tensor, block_size: int,
                 num_slots: int) -> tuple[BlockMask, object]:
        """Device side: the lists written into the buffer; the bucket's mask and call."""
        padded, kv_idx = pack.get(parts["padded"]), pack.get(parts["kv_idx"])
        bucket = padded.shape[1]
        self.kv_idx[:kv_idx.shape[0], :kv_idx.shape[1]].copy_(kv_idx)
        lists = {"kv_num": padded[0].to(torch.int32), "kv_idx": self.kv_idx[:bucket]}
        mask = decode_block_mask(lists, page_map, padded[1], padded[2], block_size, num_slots)
        return mask, self.fns[bucket]
