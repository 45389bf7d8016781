"""Decode steps through CUDA graphs: static inputs per batch-size bucket, captured at start-up.

What belongs here: the static input buffers a decode graph reads, filling them
(with padding) from a step's inputs, capturing one graph per bucket and replaying
it. What does not: deciding whether graphs may run at all (the runner checks the
device, ``enforce_eager``, the model's ``supports_cuda_graphs`` and the kernel
backend) and everything after the forward (logits, sampling).

Buckets. A decode step of B sequences runs the graph of the smallest bucket
size n >= B. Rows B..n-1 are padding: token 0 at position 0 with seq_len 1, a
block-table row of null blocks and slot -1 in every group, so padding stores
nothing and its attention reads only the null block (never written, zeros).
Only the first B rows of the output belong to real sequences.

Buffers. One set per bucket: bucket n's graph was captured on its views, so
each replay reads the same addresses. A bucket's inputs (ids, positions,
seq_lens, and per KV-cache group the slot mapping and the block table
``[n, blocks for max_model_len]``) are contiguous typed views of one device
buffer, rewritten each step whole by a single host-to-device copy from a pinned
mirror (:class:`_Bucket`): columns past a sequence's table hold the null block,
so no row keeps a block id its sequence no longer owns.

Capture. The context passed at capture is ``decode_only`` with ``max_seq_len =
max_model_len``: the forward sizes its work from n and that bound only and reads
the actual lengths from the device (the contract in forward_context.py), so one
graph serves any mix of sequence lengths. Buckets are captured largest first
into one shared memory pool, each after warm-up forwards (Triton compiles,
cuBLAS picks its kernels, the allocator settles). A replay's output lives in the
pool and stays valid until the next replay.

Without capture (``capture=False``) :meth:`DecodeGraphs.run` runs the model
eagerly on the same padded static views, as a replay would run it: with the
capture's host context (lengths of 1: a forward that read the host lengths would
differ here too) and into the bucket's held output, which the bucket's next step
overwrites (as it does a graph's), and so do the context pass and the proposals.
The CPU tests use that mode to check padding, slots and slicing without a GPU.

Model drafters (spec/drafter.py, ``graph_safe``): a bucket's graph then holds the
drafter's forward (the target's with what the drafter keeps), a second graph per
bucket its context pass (:meth:`DecodeGraphs.run_after`), and :class:`DraftGraphs`
the proposal per bucket of committed sequences, on static :class:`DraftRows`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import launch
from deepinfer.models.dspark import DraftSampling
from deepinfer.runner.inputs import StepInputs
from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.spec.drafter import DraftGraphRunner, DraftOutput, DraftRows, ModelDrafter

logger = logging.getLogger(__name__)


def _static(held: Any, out: Any) -> Any:
    """Without capture, a step's eager output written into the bucket's held output (``held``,
    the first step's, None then) and that returned: as a replay's, it is overwritten by the
    bucket's next step, so a caller that reads it later sees what it would see on the GPU."""
    if held is None:
        return out
    if isinstance(out, torch.Tensor):
        return held.copy_(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_static(h, o) for h, o in zip(held, out))
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(held, **{f.name: _static(getattr(held, f.name), getattr(out, f.name))
                                            for f in dataclasses.fields(out)})
    return out

# Forwards per bucket before its capture.
_WARMUP_RUNS = 2
# Byte alignment of each field in a bucket's packed input buffer.
_ALIGN = 16
# Up to this many sequences a step writes block-table rows one by one; above, through one
# numpy conversion of the padded rows.
_ROW_LOOP_MAX = 32
_NUMPY = {torch.long: np.int64, torch.int32: np.int32}


def max_blocks_per_seq(group: KVCacheGroup, max_model_len: int) -> int:
    """Widest block table a sequence of at most ``max_model_len`` tokens has in ``group``."""
    entries = max_model_len // group.compress_ratio if group.kind == "compressed" else max_model_len
    return max(1, -(-entries // group.block_size))


class _Bucket:
    """Bucket n's static inputs: contiguous typed views of one device buffer, rewritten each
    step by a single host-to-device copy from a pinned host mirror of the same layout.

    One copy instead of one per tensor: a decode step's inputs are a dozen tiny tensors, and
    each separate copy costs host time (staging) and a few microseconds of the stream between
    two replays. Two mirrors alternate: the host fills one while the copy from the other may
    still be queued behind the step the device is running (overlapped scheduling); a mirror
    is reused only once its previous copy has completed (an event, normally long passed).
    """

    def __init__(self, n: int, widths: Sequence[int], device: torch.device) -> None:
        fields = [("input_ids", torch.long, (n,)), ("positions", torch.long, (n,)),
                  ("seq_lens", torch.int32, (n,))]
        fields += [(f"slots{g}", torch.long, (n,)) for g in range(len(widths))]
        fields += [(f"table{g}", torch.int32, (n, w)) for g, w in enumerate(widths)]
        layout, size = [], 0
        for name, dtype, shape in fields:
            nbytes = math.prod(shape) * dtype.itemsize
            layout.append((name, dtype, shape, size, nbytes))
            size += -(-nbytes // _ALIGN) * _ALIGN
        self.n = n
        self.num_groups = len(widths)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.views = {name: self.buffer[off:off + nb].view(dtype).view(shape)
                      for name, dtype, shape, off, nb in layout}
        pinned = device.type == "cuda"
        self._mirrors = [torch.zeros(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._host = [{name: m.numpy()[off:off + nb].view(_NUMPY[dtype]).reshape(shape)
                       for name, dtype, shape, off, nb in layout} for m in self._mirrors]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # The rows of a decode step: sequence b is row b, whatever the step (never rewritten).
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n+1]
        self.token_seq = torch.arange(n, dtype=torch.int32, device=device)           # [n]
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row padding (token 0 at position 0, seq_len 1, slot -1, null blocks)."""
        host = self.host()
        for name, view in host.items():
            view.fill(1 if name == "seq_lens" else -1 if name.startswith("slots") else 0)
        self.upload()

    def host(self) -> dict[str, np.ndarray]:
        """The mirror to fill for the next :meth:`upload` (its last copy has completed)."""
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
        return self._host[self._turn]

    def upload(self) -> None:
        """Copy the mirror :meth:`host` returned into the device buffer, in stream order."""
        mirror = self._mirrors[self._turn]
        if self.buffer.device.type == "cuda":
            self.buffer.copy_(mirror, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
        else:
            self.buffer.copy_(mirror)
        self._turn ^= 1


class DecodeGraphs:
    """Static decode inputs for batch-size buckets ``sizes`` and, with ``capture``,
    one CUDA graph per bucket (the KV caches must already be bound to the model's layers).
    ``forward(input_ids, ctx)`` is what a graph holds: the model's forward by default, or a
    model drafter's (the target's forward and what the drafter keeps of it, a tuple whose
    second item is the drafter's state). ``after(state, next_ids, ctx)``: a model drafter's
    context pass, captured per bucket after the forward (:meth:`run_after`)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, groups: Sequence[KVCacheGroup], sizes: Sequence[int],
                 max_model_len: int, device: torch.device, capture: bool,
                 forward: Callable[[torch.Tensor, ForwardContext], Any] | None = None,
                 after: Callable[[Any, torch.Tensor, ForwardContext], torch.Tensor] | None = None) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graph batch sizes {list(sizes)} must be a non-empty list of ints >= 1")
        self.model = model
        self.forward = forward if forward is not None else model
        self.groups = list(groups)
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.device = device
        widths = [max_blocks_per_seq(g, max_model_len) for g in self.groups]
        self.buckets = {n: _Bucket(n, widths, device) for n in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.after = after
        # Per bucket: the rows' next tokens the context pass reads (written from the device each step).
        self.next_ids = ({n: torch.zeros(n, dtype=torch.long, device=device) for n in self.sizes}
                         if after is not None else {})
        self.after_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.after_outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences, or None when none does."""
        return next((n for n in self.sizes if n >= num_seqs), None)

    def holds(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` is a bucket's static token buffer (from :meth:`prepare`)."""
        ptr = input_ids.untyped_storage().data_ptr()
        return any(ptr == b.buffer.untyped_storage().data_ptr() for b in self.buckets.values())

    # -- one step ----------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, inputs: StepInputs) -> tuple[torch.Tensor, ForwardContext]:
        """Write a decode step's inputs (B sequences) into bucket n's static buffers, padding
        rows B..n-1, with one host-to-device copy; returns (input ids [n], context) as views."""
        if not inputs.decode_only:
            raise ValueError("decode graphs take decode-only steps (one new token per sequence)")
        b = inputs.num_seqs
        n = self.bucket_for(b)
        if n is None:
            raise ValueError(f"a decode step of {b} sequences exceeds the largest graph bucket "
                             f"{self.max_batch_size}")
        bucket = self.buckets[n]
        host = bucket.host()
        host["input_ids"][:b] = inputs.input_ids
        host["input_ids"][b:] = 0
        host["positions"][:b] = inputs.positions
        host["positions"][b:] = 0
        host["seq_lens"][:b] = inputs.seq_lens
        host["seq_lens"][b:] = 1
        for gid in range(bucket.num_groups):
            rows, table = inputs.block_tables[gid], host[f"table{gid}"]
            width = max(1, max(len(r) for r in rows))
            if width > table.shape[1]:
                raise ValueError(f"KV-cache group {gid}: a block table of {width} blocks exceeds the "
                                 f"{table.shape[1]} that max_model_len={self.max_model_len} allows")
            # Whole rows: columns past a sequence's table (and padding rows) hold the null block.
            table.fill(0)
            if b <= _ROW_LOOP_MAX:
                for i, r in enumerate(rows):
                    table[i, :len(r)] = r
            else:
                table[:b, :width] = np.asarray([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
            slots = host[f"slots{gid}"]
            slots[:b] = inputs.slot_mappings[gid]
            slots[b:] = -1
        bucket.upload()
        return bucket.views["input_ids"], self._context(n, inputs.seq_lens + [1] * (n - b))

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> Any:
        """The forward's output (hidden states [n, H], or a drafter's tuple) of a step from
        :meth:`prepare`: the captured graph's replay, or without capture the eager forward
        over the same padded views. Neither reads ``ctx`` (the step's own host context, kept
        in the signature for the eager path's callers): both see the capture's."""
        n = input_ids.shape[0]
        graph = self.graphs.get(n)
        if graph is None:
            # As a replay would: the host side of the context is the capture's (lengths of 1,
            # nothing memoised), the actual lengths only on the device; the output is the
            # bucket's, overwritten by its next step.
            out = self.forward(input_ids, self._context(n, [1] * n))
            self.outputs[n] = _static(self.outputs.get(n), out)
            return self.outputs[n]
        graph.replay()
        return self.outputs[n]

    def run_after(self, state: Any, next_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The context pass of a step from :meth:`prepare` whose forward :meth:`run` just ran:
        ``next_ids`` [n] copied into the bucket's buffer, then the captured graph's replay (its
        output valid until the next), or without capture the pass run eagerly on the views."""
        n = next_ids.shape[0]
        self.next_ids[n].copy_(next_ids)
        graph = self.after_graphs.get(n)
        if graph is None:
            out = self.after(state, self.next_ids[n], self._context(n, [1] * n))
            self.after_outputs[n] = _static(self.after_outputs.get(n), out)
            return self.after_outputs[n]
        graph.replay()
        return self.after_outputs[n]

    def _context(self, n: int, seq_lens: list[int]) -> ForwardContext:
        bucket = self.buckets[n]
        views = bucket.views
        groups = [GroupMetadata(block_size=g.block_size, block_table=views[f"table{gid}"],
                                slot_mapping=views[f"slots{gid}"]) for gid, g in enumerate(self.groups)]
        return ForwardContext(positions=views["positions"], query_start_loc=list(range(n + 1)),
                              seq_lens=seq_lens, groups=groups,
                              query_start_loc_t=bucket.query_start_loc,
                              seq_lens_t=views["seq_lens"], token_seq=bucket.token_seq,
                              max_seq_len=self.max_model_len, decode_only=True)

    # -- capture -------------------------------------------------------------------
    def _capture(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            # Every row is padding while capturing: the warm-up forwards store nothing.
            self.buckets[n].fill_padding()
            ids = self.buckets[n].views["input_ids"]
            for _ in range(_WARMUP_RUNS):
                self.forward(ids, self._context(n, [1] * n))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # A fresh context: one that a warm-up forward used holds results of that forward
            # (ForwardContext.memo), which the graph must compute itself.
            ctx = self._context(n, [1] * n)
            try:
                with launch.graph_capture(graph, pool):
                    self.outputs[n] = self.forward(ids, ctx)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode forward of {type(self.model).__name__} at batch size {n} "
                    f"failed ({exc}); its forward must not synchronise with the host in a decode_only "
                    "context (forward_context.py). Run with enforce_eager=True meanwhile") from exc
            self.graphs[n] = graph
            if self.after is not None:
                self._capture_after(n, pool)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
                    len(self.graphs), self.sizes, time.perf_counter() - start, used / 2**20)


    def _capture_after(self, n: int, pool: Any) -> None:
        """Bucket n's context pass, reading the state its forward graph leaves (padding rows
        only while capturing: the pass stores nothing)."""
        state = self.outputs[n][1]
        for _ in range(_WARMUP_RUNS):
            self.after(state, self.next_ids[n], self._context(n, [1] * n))
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        ctx = self._context(n, [1] * n)
        try:
            with launch.graph_capture(graph, pool):
                self.after_outputs[n] = self.after(state, self.next_ids[n], ctx)
        except RuntimeError as exc:
            raise RuntimeError(f"capturing the drafter's context pass at batch size {n} failed ({exc}); it must "
                               "not synchronise with the host. Run with speculative_config cuda_graphs=False "
                               "meanwhile") from exc
        self.after_graphs[n] = graph


# A proposal's sampling, each a graph per bucket: every row greedy; sampled (temperature and
# noise); sampled with the min-p / top-k / top-p filters (every row's, off where unset).
DRAFT_MODES = ("greedy", "sampled", "filtered")


class DraftGraphs(DraftGraphRunner):
    """A model drafter's proposal (:meth:`ModelDrafter.draft`) per batch bucket: static
    :class:`DraftRows` buffers (prefix views of one set sized for the largest bucket) and,
    with ``capture``, one CUDA graph per bucket and mode (``DRAFT_MODES``): every row greedy;
    sampled (temperature and the exponential-race noise, drawn outside the graph by
    spec/draft_sampling.py); sampled with filters. A step takes the mode the eager path's
    :class:`DraftSampling` has (filters on every row once one row has any), so the graph
    computes what the eager proposal computes.

    B committed sequences take the smallest bucket n >= B; rows B..n-1 are padding: a
    null-block table row, so they read only the null block and write nothing (a chained
    drafter's slots there are -1), and their outputs are never read. A step
    of B above the largest bucket gets None from :meth:`draft` and runs eagerly.

    Outputs live in the graphs' pool until the next replay of the same graph: the tokens and
    confidences are copied to the host at once; the draft distributions, which verification
    reads a step (or more, when a sequence waits) later, are cloned.
    """

    @torch.inference_mode()
    def __init__(self, drafter: ModelDrafter, decode: DecodeGraphs, sizes: Sequence[int], table_width: int,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device, capture: bool) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"draft graph batch sizes {list(sizes)} must be a non-empty list of ints >= 1")
        self.drafter = drafter
        self.decode = decode          # whose buckets hold the drafter's forward and context pass
        self.sizes = sorted(set(sizes))
        self.max_seq_len = max_seq_len
        self.device = device
        n = self.sizes[-1]
        self.anchors = torch.zeros(n, dtype=torch.long, device=device)
        self.last_positions = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, table_width, dtype=torch.int32, device=device)
        self.hidden = (torch.zeros(n, drafter.row_state_size, dtype=dtype, device=device)
                       if drafter.row_state_size else None)
        self.greedy = torch.ones(n, dtype=torch.bool, device=device)
        self.temperature = torch.ones(n, dtype=torch.float32, device=device)
        self.noise = torch.ones(n, drafter.num_slots, drafter.vocab_size, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.full((n,), drafter.vocab_size, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], DraftOutput] = {}
        self.steps = 0          # proposals that went through the static buffers (replays, with capture)
        if capture:
            self._capture()

    @staticmethod
    def static_bytes(drafter: ModelDrafter, n: int, dtype: torch.dtype) -> int:
        """Bytes of the static buffers :meth:`__init__` allocates for a largest bucket of ``n``
        (the cache budget reserves them before the cache is laid out)."""
        # The noise and the kept hidden rows; then the per-row scalars (3 int64, 3 float32, a bool)
        # and a 64-byte allowance for the row's block table, which is small beside them.
        per_row = (drafter.num_slots * drafter.vocab_size * 4 + drafter.row_state_size * dtype.itemsize
                   + 3 * 8 + 3 * 4 + 1 + 64)
        return n * per_row

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((n for n in self.sizes if n >= num_seqs), None)

    def context_pass(self, state: Any, next_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        if self.decode.after is None:
            return None
        return self.decode.run_after(state, next_ids, ctx)

    def rows(self, n: int, mode: str) -> DraftRows:
        """Bucket n's static rows (views) for a ``DRAFT_MODES`` mode."""
        sampling = None
        if mode != "greedy":
            filters = mode == "filtered"
            sampling = DraftSampling(greedy=self.greedy[:n], temperature=self.temperature[:n],
                                     min_p=self.min_p[:n] if filters else None,
                                     top_k=self.top_k[:n] if filters else None,
                                     top_p=self.top_p[:n] if filters else None, noise=self.noise[:n])
        return DraftRows(anchors=self.anchors[:n], last_positions=self.last_positions[:n], tables=self.tables[:n],
                         max_seq_len=self.max_seq_len, hidden=None if self.hidden is None else self.hidden[:n],
                         sampling=sampling)

    def _pad(self, b: int, n: int) -> None:
        """Rows b..n-1 padding (greedy, filters off), for capture."""
        self.anchors[b:n].zero_()
        self.last_positions[b:n].zero_()
        self.tables[b:n].zero_()
        self.greedy[b:n].fill_(True)
        self.temperature[b:n].fill_(1.0)
        self.min_p[b:n].zero_()
        self.top_k[b:n].fill_(self.drafter.vocab_size)
        self.top_p[b:n].fill_(1.0)

    @torch.inference_mode()
    def draft(self, rows: DraftRows) -> DraftOutput | None:
        b = rows.anchors.shape[0]
        n = self.bucket_for(b)
        if n is None:
            return None
        width = rows.tables.shape[1]
        if width > self.tables.shape[1]:
            raise ValueError(f"a drafter block table of {width} blocks exceeds the {self.tables.shape[1]} "
                             "the draft graphs hold")
        self.anchors[:b].copy_(rows.anchors)
        self.last_positions[:b].copy_(rows.last_positions)
        self.tables[:b, :width].copy_(rows.tables)
        if width < self.tables.shape[1]:
            self.tables[:b, width:].zero_()
        if self.hidden is not None:
            self.hidden[:b].copy_(rows.hidden)
        sampling = rows.sampling
        mode = "greedy" if sampling is None else "sampled" if sampling.top_k is None else "filtered"
        if sampling is not None:
            self.greedy[:b].copy_(sampling.greedy)
            self.temperature[:b].copy_(sampling.temperature)
            self.noise[:b].copy_(sampling.noise)
        if mode == "filtered":
            self.min_p[:b].copy_(sampling.min_p)
            self.top_k[:b].copy_(sampling.top_k)
            self.top_p[:b].copy_(sampling.top_p)
        if b < n:
            # Only the padding rows' tables need clearing (a stale row would write a chained
            # drafter's KV into blocks it no longer owns); their other fields hold an earlier
            # step's valid values, and their outputs are never read.
            self.tables[b:n].zero_()
        graph = self.graphs.get((n, mode))
        if graph is None:
            out = _static(self.outputs.get((n, mode)), self.drafter.draft(self.rows(n, mode)))
            self.outputs[(n, mode)] = out
        else:
            graph.replay()
            out = self.outputs[(n, mode)]
        self.steps += 1
        return DraftOutput(tokens=out.tokens[:b],
                           confidences=None if out.confidences is None else out.confidences[:b],
                           probs=None if out.probs is None else out.probs[:b].clone())

    def _capture(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            for mode in DRAFT_MODES:
                # Every row padding while capturing: the warm-ups read only the null block.
                self._pad(0, n)
                for _ in range(_WARMUP_RUNS):
                    self.drafter.draft(self.rows(n, mode))
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                try:
                    with launch.graph_capture(graph, pool):
                        self.outputs[(n, mode)] = self.drafter.draft(self.rows(n, mode))
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"capturing the {mode} proposal of {type(self.drafter).__name__} at batch size {n} failed "
                        f"({exc}); ModelDrafter.draft must not synchronise with the host. Run with "
                        "speculative_config cuda_graphs=False meanwhile") from exc
                self.graphs[(n, mode)] = graph
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d draft CUDA graphs (batch sizes %s, greedy, sampled, filtered) in %.1f s, %.0f MiB",
                    len(self.graphs), self.sizes, time.perf_counter() - start, used / 2**20)
