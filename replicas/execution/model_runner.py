"""One forward pass per iteration over the packed batch, with paged attention.

The HF model's own modules do everything but attention. Our attention function is
registered with `transformers.AttentionInterface` (`replicas.execution.attention`); it receives q/k/v for
ALL packed tokens of the step (positions already applied), writes k/v into the paged cache, and
attends through the runner's backend ("sdpa" or "flex", see `replicas.execution.attention`).

`run` is one pass, as nano-vllm's `ModelRunner.run`: prepare -> forward -> sample, returning
the token ids. Per-pass metadata (token ids, positions, slots, block tables, keep rows, and the
sampler's inputs) is built on the host with numpy, packed into one buffer and sent to the device
in one copy (`replicas.execution.transfer`); it reaches every layer through the model's **kwargs. The
sampler runs on the device and its results come back in one copy. Block tables live in a
persistent host array (a row per request, a block written in when it is allocated), not rebuilt
from lists every pass.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.fx.experimental import _config as shape_config  # torch.compile's symbolic shapes
from transformers import PreTrainedModel

from replicas.execution.attention import ATTN_IMPL, PassLayout, PassMeta, PrefillSpan, paged_attention, resolve_backend
from replicas.execution.attention_flex import Q_TILE, FlexBackend, PageMap, bucket_width, flex_call
from replicas.execution.attention_sdpa import PAD_MIN, PAD_SLACK, SdpaBackend, compiled_decode, decode_groups
from replicas.execution.compiling import CompileCounter, own_copy
from replicas.execution.cuda_graphs import DecodeGraphs
from replicas.execution.flex_buckets import DecodeBuckets, bucket_sizes
from replicas.scheduling.kv_cache import BlockManager
from replicas.loading.model_support import heads_per_rank, kv_shape
from replicas.request import Request
from replicas.execution.sampler import Sampler, SamplingPlan
from replicas.scheduling.batch import ScheduledSeq, SchedulerOutput
from replicas.execution.device_queue import Immediate, Job, StandInDevice
from replicas.execution.overlap import TokenSlots
from replicas.execution.parallel import any_rank, receive_tokens
from replicas.execution.transfer import HostPack, Part, Readback, Staging

log = logging.getLogger(__name__)
WARM_UP_ROUNDS = 3

__all__ = ["ATTN_IMPL", "PAD_MIN", "PAD_SLACK", "ModelRunner", "PassLogits", "paged_attention"]

@dataclass
class PassLogits:
    """What a pass keeps of the model's logits: nothing for the positions nobody reads."""

    sampled: torch.Tensor  # (N, V) the sequences that sample, in batch order
    # (M, V) positions whose next token is a prompt token, for the requests that score their
    # prompt (SamplingParams.prompt_logprobs): row i scores the token after its position.
    prompt: torch.Tensor
    # (request, rows) in the order of `prompt`: its next `rows` prompt tokens are scored, from
    # token len(request.prompt_logprobs) + 1 on.
    prompt_spans: list[tuple[Request, int]]
    sampling: SamplingPlan  # the pass's sampling, planned into its upload
    pack: HostPack  # the pass's upload (the sampling plan's parts are in it)


class ModelRunner:
    """Owns the KV tensors and runs one packed forward pass per scheduler output."""

    def __init__(self, model: PreTrainedModel, blocks: BlockManager, max_model_len: int,
                 compile_decode_attention: bool = False, attention_backend: str = "auto",
                 cuda_graphs: bool | None = None, max_num_seqs: int = 128,
                 compile_backend: str | None = None, graph_sizes: tuple[int, ...] | None = None,
                 sampler: Sampler | None = None, tensor_parallel_size: int = 1, peers: Any = None) -> None:
        """`attention_backend`: "auto" (flex on CUDA, sdpa elsewhere), "sdpa" or "flex".
        `cuda_graphs`: decode-only passes replay a graph captured at start per batch-size bucket
        up to `max_num_seqs` (None: on CUDA with the flex backend; needs flex); `graph_sizes`:
        those buckets instead (EngineConfig.cuda_graph_sizes).
        `compile_backend`: the torch.compile backend of the flex path (its attention calls and
        the decode step); None: inductor on CUDA, nothing compiled elsewhere (tests pass "eager").

        If the flex path fails to start (a compile, a capture, whatever the exception), the
        runner logs a WARNING and runs the eager SDPA path instead: `path` says which runs.
        `sampler`: how each pass picks its tokens (None: no logits processors, no grammars).
        `tensor_parallel_size`: the model is this rank's shard; the KV cache holds this rank's
        heads. `peers` (rank 0 of a group, `execution.parallel.Peers`): every worker builds a
        runner like this one now, and replays each pass's forward (`forward`, `replay`)."""
        self.peers = peers
        self.tensor_parallel_size = tensor_parallel_size
        if peers is not None:
            peers.build({"num_blocks": blocks.num_blocks, "block_size": blocks.block_size,
                         "max_model_len": max_model_len, "compile_decode_attention": compile_decode_attention,
                         "attention_backend": attention_backend, "cuda_graphs": cuda_graphs,
                         "max_num_seqs": max_num_seqs, "compile_backend": compile_backend,
                         "graph_sizes": graph_sizes, "tensor_parallel_size": tensor_parallel_size})
        self.model = model
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.sampler = sampler or Sampler(self.device, model.get_output_embeddings().weight.shape[0])
        layers, _, head_dim = kv_shape(model.config)
        self.heads, kv_heads = heads_per_rank(model.config, tensor_parallel_size)  # this rank's
        self.num_pages = blocks.num_blocks  # the cache's, the scratch block included
        shape = (layers, self.num_pages * blocks.block_size, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_layers, self.v_layers = self.k_cache.unbind(0), self.v_cache.unbind(0)  # see PassMeta
        model.set_attn_implementation(ATTN_IMPL)
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Two upload buffers, in turn: on CPU a pass's device side reads its buffer in place, and
        # in the overlapped loop the next pass is prepared while it runs.
        self._stagings = (Staging(self.device), Staging(self.device))
        self._staging_turn = 0
        # Where each pass's device side runs (`replicas.execution.device_queue`), and, in the overlapped
        # loop, each runner row's latest sampled token on the device (`use_overlap`).
        self.device_queue: Immediate | StandInDevice = Immediate()
        self.token_slots: TokenSlots | None = None
        # Persistent block table, on the host: one row per request in recent passes (see _row).
        # Each pass's metadata is sliced from it with numpy (microseconds, where a small torch op
        # costs ~10 us on CPU) and handed to the device in the pass's one upload. A pass holds at
        # most max_num_seqs requests and a row outlives its request by one pass: 2 x max_num_seqs
        # rows, and one more for the padding rows of captured passes (the page map's last).
        width = -(-max_model_len // blocks.block_size)
        rows = 2 * max_num_seqs + 1
        self.max_num_seqs = max_num_seqs
        self._table = np.zeros((rows, width), dtype=np.int64)
        self._free_rows: list[int] = list(range(rows - 2, -1, -1))
        # request -> [row, blocks written, preemptions when written]
        self._rows: dict[Request, list[int]] = {}
        self._live: dict[Request, list[int]] = {}
        self._new_rows = False  # a request got an entry this pass (see _end_pass)
        self.attention_backend = resolve_backend(attention_backend, self.device)
        if cuda_graphs is None:
            cuda_graphs = graphs_by_default(self.device.type, self.attention_backend, tensor_parallel_size)
        if cuda_graphs and self.attention_backend != "flex":
            raise ValueError("cuda_graphs needs the flex attention backend (static shapes)")
        self.cuda_graphs = cuda_graphs
        self.page_map: PageMap | None = None
        self.compiler: CompileCounter | None = None
        self.graphs: DecodeGraphs | None = None
        self.fallback_error: str | None = None
        if self.attention_backend == "flex":
            try:
                self._start_flex(sorted(set(graph_sizes)) if graph_sizes else bucket_sizes(max_num_seqs),
                                 compile_backend)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the replica serves
                if tensor_parallel_size > 1:  # not alone: a rank on another path would be out of step
                    raise
                self.fallback_error = f"{type(exc).__name__}: {exc}"
                log.warning("the flex attention path failed to start (%s); running the eager SDPA path",
                            self.fallback_error, exc_info=True)
                self.attention_backend, self.cuda_graphs = "sdpa", False
                self.page_map = self.graphs = None
        if self.attention_backend == "sdpa":
            fused = None
            if compile_decode_attention:
                fused = compiled_decode(self.k_cache, self.v_cache, blocks.block_size, self.heads)
            self.backend = SdpaBackend(blocks.block_size, fused)

    @property
    def path(self) -> str:
        """What runs: "flex+graphs", "flex" or "sdpa", and "sdpa (fallback)" after a failed start."""
        if self.fallback_error is not None:
            return "sdpa (fallback)"
        return "flex+graphs" if self.graphs is not None else self.attention_backend

    def use_overlap(self) -> None:
        """Keep each runner row's sampled token on the device, for the next pass's decodes."""
        self.token_slots = TokenSlots(self._table.shape[0], self.device)

    @property
    def compiles(self) -> tuple[int, int]:
        """Graphs compiled by this runner: (since start, after warm-up)."""
        c = self.compiler
        return (c.compiles, c.after_warmup) if c is not None else (0, 0)

    def _start_flex(self, buckets: list[int], compile_backend: str | None) -> None:
        """The flex backend, its compiled callables (this runner's own) and the decode graphs,
        every shape a pass can bring compiled now (`warm_up`)."""
        bs = self.blocks.block_size
        self.page_map = PageMap(self._table.shape[0], self.num_pages, self.device)
        if compile_backend is None and self.device.type == "cuda":
            compile_backend = "inductor"
        self.compiler = CompileCounter(compile_backend) if compile_backend else None
        attend_fn = decode_buckets = None
        if self.compiler is not None:  # dynamic in rows and list widths; 0/1 sizes warm up apart
            attend_fn = torch.compile(own_copy(flex_call), backend=self.compiler, dynamic=True)
            # the decodes of mixed passes at static shapes, a call per bucket (flex's decoding kernel)
            decode_buckets = DecodeBuckets(
                bucket_sizes(self.max_num_seqs), bucket_width(-(-self.max_model_len // bs)), self.page_map.pad_row,
                self.device, lambda: torch.compile(own_copy(flex_call), backend=self.compiler, dynamic=False))
        self.backend = FlexBackend(bs, self.num_pages, self.page_map, self.device, attend_fn,
                                   decode_buckets=decode_buckets)
        if self.cuda_graphs:
            self.graphs = DecodeGraphs(self, buckets, self.blocks.reserve(), self.compiler,
                                       capture=self.device.type == "cuda")
        self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every shape group a pass can bring through the compiled callables, so none
        compiles in serving: decode calls of one and of several entries, prefill chunks of one
        and of several rows (list widths and tile counts are never 1, see attention_flex), each
        decode bucket. Under inference mode, as the passes run."""
        if self.compiler is None:
            return
        with shape_config.patch(use_duck_shape=False):
            # Until a round compiles nothing: a compile can change state a guard reads (the
            # `kernels` package's hub hooks leave a global set after the first one).
            for _ in range(WARM_UP_ROUNDS):
                before = self.compiler.compiles
                self._warm_attention()
                if self.graphs is not None:
                    self.graphs.warm_up()
                compiled = self.compiler.compiles != before
                if self.tensor_parallel_size > 1:  # every rank runs as many rounds: they meet inside
                    compiled = any_rank(compiled, self.device)
                if not compiled:
                    break
            else:
                raise RuntimeError(f"warm-up still compiling after {WARM_UP_ROUNDS} rounds")
            if self.graphs is not None:
                self.graphs.capture_all()
        self.compiler.warm = True

    def _warm_attention(self) -> None:
        """One layer's attention, reading nothing (the page map has no entry for these rows), for
        each shape group: decodes alone (each bucket), chunks alone (1 row, 3 rows, two tiles),
        decodes with a chunk."""
        bs, heads = self.blocks.block_size, self.heads
        head_dim = self.k_cache.shape[-1]
        attn = next(m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling"))
        width = -(-(2 + Q_TILE + 3) // bs)
        buckets = self.backend.decode_buckets.buckets
        table = np.arange(width, dtype=np.int64)[None].repeat(max(3, buckets[-1]), 0) % self.num_pages
        for decodes, chunk in [(b, 0) for b in buckets] + [(0, 1), (0, 3), (2, Q_TILE + 3)]:
            start = 2 if chunk else 0
            spans = [PrefillSpan(decodes, chunk, start, 2)] if chunk else []
            layout = PassLayout(table, bs, list(range(decodes)), [2 + i for i in range(decodes)], spans,
                                decodes + chunk, [])
            pack = HostPack()
            plan = self.backend.plan(layout, pack)
            pos = np.array([1 + i for i in range(decodes)] + list(range(start, start + chunk)), dtype=np.int64)
            pos_part = pack.add(pos)
            pack.send(self.device, self._stagings[0])
            meta = self.backend.metadata(plan, pack, pack.get(pos_part))
            q = torch.zeros((decodes + chunk, heads, head_dim), dtype=self.dtype, device=self.device)
            kc, vc = self.k_cache[0], self.v_cache[0]
            meta.attend(attn, q, None, None, kc, vc, attn.scaling)

    def _row(self, req: Request, table: list[int]) -> int:
        """The request's row of the persistent block table (`table`: its block table now), its
        new blocks written in.

        A preempted request comes back with new blocks (its entry remembers the preemption
        count it was written for). A request absent from a pass gives its row back (rows are
        cheap to fill again).
        """
        entry = self._rows.get(req)
        if entry is None or entry[2] != req.num_preemptions:
            if entry is not None and self.page_map is not None:  # preempted: its old blocks are not its
                self.page_map.clear(entry[0], self._table[entry[0], :entry[1]])
            row = entry[0] if entry is not None else self._take_row()
            entry = [row, 0, req.num_preemptions]
            self._new_rows = True
        row, have = entry[0], entry[1]
        if have < len(table):
            self._table[row, have:len(table)] = table[have:]
            if self.page_map is not None:
                self.page_map.write(row, have, table[have:])
            entry[1] = len(table)
        self._live[req] = entry
        return row

    def _decode_columns(self, decodes: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The decodes' positions, block-table rows (`_row`) and input tokens (-1: in flight,
        read from its row's slot on the device), in batch order, from one walk. A decode whose
        row already holds the block of its position (all but one pass in block_size) is a dict
        lookup."""
        rows_get, live, bs = self._rows.get, self._live, self.blocks.block_size
        table_of, slow = self.blocks.block_table, self._row
        starts, rows, tokens = [], [], []
        for seq in decodes:
            req, start = seq.request, seq.start
            entry = rows_get(req)
            if entry is None or entry[1] * bs <= start or entry[2] != req.num_preemptions:
                rows.append(slow(req, table_of(req.request_id)))
            else:
                live[req] = entry
                rows.append(entry[0])
            starts.append(start)
            tokens.append(-1 if req.num_inflight else req.output_token_ids[-1])
        return (np.array(starts, dtype=np.int64), np.array(rows, dtype=np.int64),
                np.array(tokens, dtype=np.int64))

    def _take_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"no free block-table row: more than {self._table.shape[0] // 2} requests "
                               "in one pass (max_num_seqs)")
        return self._free_rows.pop()

    def _end_pass(self) -> None:
        """Rows of requests that were not in this pass go back to the free list."""
        live = self._live
        if self._new_rows or len(live) != len(self._rows):  # else the same requests as last pass
            for req, entry in self._rows.items():
                if req not in live:
                    self._free_rows.append(entry[0])
                    if self.page_map is not None:
                        self.page_map.clear(entry[0], self._table[entry[0], :entry[1]])
        self._rows, self._live, self._new_rows = live, {}, False

    def _decode_groups(self, lens: np.ndarray, rows: np.ndarray) -> list:
        """Decodes (sorted by context length `lens`) in groups whose padding stays small (the
        SDPA backend's batched calls)."""
        return decode_groups(lens, rows, self._table, self.blocks.block_size)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> list[int]:
        """One pass: prepare and upload, forward, sample. Returns the token of each sequence that
        samples (`ScheduledSeq.samples`), in batch order; the requests that ask for logprobs or
        prompt logprobs get them recorded. One copy to the device and one back."""
        return self.collect(self.launch(batch))

    def launch(self, batch: SchedulerOutput) -> Launched:
        """The pass's host side (`prepare`), then its device side handed to the device queue:
        forward, sampling, the sampled tokens into their rows' slots (the overlapped loop), the
        copy back started. `collect` returns its tokens."""
        prep = self.prepare(batch)
        return Launched(prep.logits_plan, self.device_queue.submit(lambda: self._device_side(prep)))

    def collect(self, launched: Launched) -> list[int]:
        """Wait for a launched pass's copy back: its tokens, in batch order (logprobs recorded)."""
        readback, _ = launched.job.result()
        return self.sampler.read_back(readback.wait(), launched.plan)

    def pass_seconds(self, launched: Launched) -> float:
        """How long the launched pass (collected already) held the device: its kernels' time by
        CUDA events, else the device queue's clock (the device's timeline, not the host's)."""
        _, events = launched.job.result()
        if events is not None:
            return events[0].elapsed_time(events[1]) / 1000
        return launched.job.finished - launched.job.started

    @torch.inference_mode()
    def _device_side(self, prep: Prepared) -> tuple[Readback, tuple | None]:
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        logits = self.forward(prep)
        parts = self.sampler.sample_on_device(logits.sampled, logits.prompt, logits.sampling, logits.pack)
        if self.token_slots is not None:  # the next pass's decodes read these on the device
            self.token_slots.write(prep.pack.get(prep.slot_rows), parts[0])
            if self.peers is not None:  # the workers' slots get them too
                self.peers.share_tokens(parts[0].to(self.device, torch.int64).contiguous())
        if events is not None:
            events[1].record()
        return Readback(parts), events

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> PassLogits:
        """Prepare and run the forward pass (`prepare`, then `forward`)."""
        return self.forward(self.prepare(batch))

    def prepare(self, batch: SchedulerOutput) -> Prepared:
        """The pass's host side: its metadata and sampling plan, uploaded in one copy.

        Decodes are packed by context length (for the grouped attention), prefill chunks after
        them; the logits come back in the batch's own order. The sampler's inputs are planned
        into the pass's upload, so the pass sends one buffer to the device. A decode whose input
        token is still in flight (`Request.num_inflight`, the overlapped loop) gets it on the
        device, from its row's slot.
        """
        # A decode runs its last sampled token at position `start`; one still in flight is read
        # from its row's slot on the device (`fill_at`: its packed row).
        starts, rows, last = self._decode_columns(batch.decodes)
        order = starts.argsort(kind="stable")  # packed by context length
        pos = starts[order]
        decode_rows = rows[order]
        ids = last[order]
        fill_at = (ids < 0).nonzero()[0]
        ids[fill_at] = 0
        # Every decode samples; its row in the packed batch is its place in `order`.
        sampled = np.empty(len(order), dtype=np.int64)
        sampled[order] = np.arange(len(order))
        prefills: list[PrefillSpan] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int]] = []
        num_tokens = len(order)
        if batch.prefills:
            chunk_ids: list[int] = []
            chunk_pos: list[int] = []
            chunk_rows: list[int] = []
            chunk_sampled: list[int] = []
            for seq in batch.prefills:
                req, start, n = seq.request, seq.start, seq.num_tokens
                row = num_tokens
                if req.params.prompt_logprobs is not None:
                    rows = _prompt_rows(req, start, n)
                    if rows:
                        prompt_rows.extend(range(row + rows.start - start, row + rows.stop - start))
                        prompt_spans.append((req, len(rows)))
                chunk_ids.extend(req.token_slice(start, start + n))
                chunk_pos.extend(range(start, start + n))
                table_row = self._row(req, self.blocks.block_table(req.request_id))
                chunk_rows.extend([table_row] * n)
                prefills.append(PrefillSpan(row, n, start, table_row))
                num_tokens += n
                if seq.samples:
                    chunk_sampled.append(num_tokens - 1)
            ids = np.concatenate((ids, np.array(chunk_ids, dtype=np.int64)))
            all_pos = np.concatenate((pos, np.array(chunk_pos, dtype=np.int64)))
            token_rows = np.concatenate((decode_rows, np.array(chunk_rows, dtype=np.int64)))
            sampled = np.concatenate((sampled, np.array(chunk_sampled, dtype=np.int64)))
        else:
            all_pos, token_rows = pos, decode_rows
        bs = self.blocks.block_size
        slots = self._table[token_rows, all_pos // bs] * bs + all_pos % bs  # where each token's k/v goes
        lens = pos + 1  # each decode's context, its new token included
        layout = PassLayout(self._table, bs, decode_rows, lens, prefills, num_tokens,
                            self._decode_groups(lens, decode_rows))
        self._end_pass()
        pack = HostPack()
        tokens = np.empty((3, num_tokens), dtype=np.int64)  # (3, T) ids, positions, slots
        tokens[0], tokens[1], tokens[2] = ids, all_pos, slots
        prep = Prepared(pack, len(sampled), prompt_spans)
        prep.map_part = self.page_map.plan(pack) if self.page_map is not None else None
        prep.bucket = self.graphs.bucket(num_tokens) if self.graphs is not None and not prefills else None
        if prep.bucket is not None:  # decode-only: the bucket's compiled (captured) step, padded
            prep.graph_inputs = self.graphs.plan(tokens, layout.decode_rows, layout.decode_lens, prep.bucket, pack)
            prep.tokens = prep.graph_inputs[0]
        else:
            prep.tokens, prep.attn = pack.add(tokens), self.backend.plan(layout, pack)
        prep.keep = pack.add(np.concatenate((sampled, np.array(prompt_rows, dtype=np.int64))) if prompt_rows
                             else sampled)
        if self.token_slots is not None:
            prep.slot_rows = pack.add(token_rows[sampled])  # each sampler's runner row
            if len(fill_at):
                prep.fill = (pack.add(fill_at), pack.add(decode_rows[fill_at]))
        samplers = [s.request for s in batch.decodes]  # every decode samples
        if batch.prefills:
            samplers += [s.request for s in batch.prefills if s.samples]
        prep.logits_plan = self.sampler.plan(samplers, prompt_spans, pack)
        self._staging_turn ^= 1  # a pass may still read the other buffer (the overlapped loop)
        pack.send(self.device, self._stagings[self._staging_turn])  # the pass's one host-to-device copy
        return prep

    def forward(self, prep: Prepared) -> PassLogits:
        """The pass's device side up to the logits of the sequences that sample, in batch order,
        and of the prompt positions of requests that score their prompt (only those rows are
        computed). Rank 0 of a tensor-parallel group first sends the pass to the workers (the
        same bytes, the same parts); a pass that then fails leaves the ranks out of step, which
        breaks the group for good (`WorkerLost`, fatal)."""
        if self.peers is None:
            return self._forward(prep)
        self.peers.forward(prep, prep.pack.host_buffer.numpy())
        try:
            return self._forward(prep)
        except Exception as exc:
            raise self.peers.broken(exc) from exc

    def _forward(self, prep: Prepared) -> PassLogits:
        pack = prep.pack
        if self.page_map is not None:
            self.page_map.apply(prep.map_part, pack)
        if prep.fill is not None:  # in-flight input tokens, from their rows' slots
            self.token_slots.fill(pack.get(prep.tokens)[0], pack.get(prep.fill[0]), pack.get(prep.fill[1]))
        keep_d = pack.get(prep.keep)
        n = prep.num_sampled
        if prep.bucket is not None:
            logits = self.graphs.run(prep.bucket, prep.graph_inputs, pack).index_select(0, keep_d)  # (N, V)
            return PassLogits(logits, logits[:0], prep.prompt_spans, prep.logits_plan, pack)
        tokens_d = pack.get(prep.tokens)
        meta = PassMeta(self.k_layers, self.v_layers, tokens_d[2], self.backend.metadata(prep.attn, pack, tokens_d[1]))
        kwargs = {"logits_to_keep": keep_d} if self._keep_logits else {}
        # Compiled attention calls: sizes that happen to be equal must not share a symbol.
        apart = shape_config.patch(use_duck_shape=False) if self.compiler is not None else contextlib.nullcontext()
        with apart:
            logits = self.model(input_ids=tokens_d[0:1], position_ids=tokens_d[1:2], use_cache=False,
                                attn_meta=meta, **kwargs).logits[0]
        logits = logits if self._keep_logits else logits[keep_d]  # (N + M, V)
        return PassLogits(logits[:n], logits[n:], prep.prompt_spans, prep.logits_plan, pack)


    @torch.inference_mode()
    def replay(self, prep: Prepared, data: np.ndarray) -> None:
        """A worker's pass: rank 0's upload (`data`) sent to this device, and the forward run on
        it as rank 0 runs it (`prep` locates the parts); the logits are rank 0's to sample."""
        self._staging_turn ^= 1
        prep.pack = HostPack.received(data, self.device, self._stagings[self._staging_turn])
        if prep.slot_rows is not None and self.token_slots is None:  # rank 0 runs the overlapped loop
            self.use_overlap()
        self.forward(prep)
        if prep.slot_rows is not None:  # rank 0's sampled tokens, into our slots (`Peers.share_tokens`)
            self.token_slots.write(prep.pack.get(prep.slot_rows), receive_tokens(prep.num_sampled, self.device))


@dataclass
class Prepared:
    """A pass's host side, done: where its parts lie in the upload, for the device side."""

    pack: HostPack
    num_sampled: int
    prompt_spans: list[tuple[Request, int]]
    logits_plan: SamplingPlan | None = None
    map_part: object = None
    bucket: int | None = None
    graph_inputs: tuple[Part, Part, Part] | None = None
    tokens: Part | None = None  # (3, T) ids, positions, slots (a graph's (4, B): rows too)
    attn: object = None
    keep: Part | None = None
    slot_rows: Part | None = None
    fill: tuple[Part, Part] | None = None  # (packed decode rows, their runner rows) read from slots


@dataclass
class Launched:
    """A pass handed to the device: `ModelRunner.collect` waits for its tokens."""

    plan: SamplingPlan
    job: Job


def graphs_by_default(device_type: str, attention_backend: str, tensor_parallel_size: int) -> bool:
    """`cuda_graphs: null`: on wherever there is something to capture (flex on CUDA), except
    across ranks: there `cuda_graphs: true` opts in (each rank compiles and captures its decode
    step in step with the others, the model's collectives inside; tested on CPU, where nothing is
    captured, but a capture of nccl collectives has not run on a device here)."""
    return device_type == "cuda" and attention_backend == "flex" and tensor_parallel_size == 1


def _prompt_rows(req: Request, start: int, n: int) -> range:
    """Positions of the chunk [start, start + n) whose logits score a prompt token not scored
    yet: position p scores token p + 1, so the prompt's last position (it samples) never does."""
    done, end = len(req.prompt_logprobs), req.num_prompt_tokens - 1  # [0, done): scored already
    if done >= end:  # all scored (a recompute after preemption scores nothing again)
        return range(0)
    if done < start:  # a gap would misalign every score after it
        raise RuntimeError(f"{req.request_id}: prompt position {done} was never run through the "
                           f"model (a chunk starts at {start}); prompt logprobs need every position")
    return range(done, max(done, min(start + n, end)))
