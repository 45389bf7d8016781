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

Buffers. One set, sized for the largest bucket; bucket n's graph was captured
on the first n rows (views), so every graph reads the same addresses and a
step only rewrites those rows. Block tables are ``[max_bs, blocks for
max_model_len]`` per group; the columns past a step's widest table are zeroed,
so no row keeps a block id its sequence no longer owns.

Capture. The context passed at capture is ``decode_only`` with ``max_seq_len =
max_model_len``: the forward sizes its work from n and that bound only and reads
the actual lengths from the device (the contract in forward_context.py), so one
graph serves any mix of sequence lengths. Buckets are captured largest first
into one shared memory pool, each after warm-up forwards (Triton compiles,
cuBLAS picks its kernels, the allocator settles). A replay's output lives in the
pool and stays valid until the next replay.

Without capture (``capture=False``) :meth:`DecodeGraphs.run` runs the model
eagerly on the same padded static views: the CPU tests use that mode to check
padding, slots and slicing without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.runner.inputs import StepInputs
from deepinfer.runner.transfer import copy_into
from deepinfer.scheduler.kv_cache import KVCacheGroup

logger = logging.getLogger(__name__)

# Forwards per bucket before its capture.
_WARMUP_RUNS = 2


def max_blocks_per_seq(group: KVCacheGroup, max_model_len: int) -> int:
    """Widest block table a sequence of at most ``max_model_len`` tokens has in ``group``."""
    entries = max_model_len // group.compress_ratio if group.kind == "compressed" else max_model_len
    return max(1, -(-entries // group.block_size))


class DecodeGraphs:
    """Static decode inputs for batch-size buckets ``sizes`` and, with ``capture``,
    one CUDA graph per bucket (the KV caches must already be bound to the model's layers)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, groups: Sequence[KVCacheGroup], sizes: Sequence[int],
                 max_model_len: int, device: torch.device, capture: bool) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graph batch sizes {list(sizes)} must be a non-empty list of ints >= 1")
        self.model = model
        self.groups = list(groups)
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)             # [max_bs]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)             # [max_bs]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)              # [max_bs]
        # One token per sequence: row b is sequence b, whatever the step.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [max_bs+1]
        self.token_seq = torch.arange(n, dtype=torch.int32, device=device)           # [max_bs]
        self.block_tables = [torch.zeros(n, max_blocks_per_seq(g, max_model_len), dtype=torch.int32,
                                         device=device) for g in self.groups]        # [max_bs, M_g]
        self.slot_mappings = [torch.full((n,), -1, dtype=torch.long, device=device)
                              for _ in self.groups]                                  # [max_bs]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences, or None when none does."""
        return next((n for n in self.sizes if n >= num_seqs), None)

    def holds(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` is a view of this object's static token buffer (from :meth:`prepare`)."""
        return input_ids.untyped_storage().data_ptr() == self.input_ids.untyped_storage().data_ptr()

    # -- one step ----------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, inputs: StepInputs) -> tuple[torch.Tensor, ForwardContext]:
        """Write a decode step's inputs (B sequences) into the first n = bucket rows of the
        static buffers, padding rows B..n-1; returns (input ids [n], context) as views."""
        if not inputs.decode_only:
            raise ValueError("decode graphs take decode-only steps (one new token per sequence)")
        b = inputs.num_seqs
        n = self.bucket_for(b)
        if n is None:
            raise ValueError(f"a decode step of {b} sequences exceeds the largest graph bucket "
                             f"{self.max_batch_size}")
        pad = n - b
        # Copies from pinned staging buffers, queued behind the step the device is running:
        # the host never waits, so overlapped scheduling can prepare step N+1 during step N.
        copy_into(self.input_ids[:n], inputs.input_ids + [0] * pad)
        copy_into(self.positions[:n], inputs.positions + [0] * pad)
        seq_lens = inputs.seq_lens + [1] * pad
        copy_into(self.seq_lens[:n], seq_lens)
        for gid, (table, slots) in enumerate(zip(self.block_tables, self.slot_mappings)):
            rows = inputs.block_tables[gid]
            width = max(1, max(len(r) for r in rows))
            if width > table.shape[1]:
                raise ValueError(f"KV-cache group {gid}: a block table of {width} blocks exceeds the "
                                 f"{table.shape[1]} that max_model_len={self.max_model_len} allows")
            padded = [r + [0] * (width - len(r)) for r in rows] + [[0] * width] * pad
            copy_into(table[:n, :width], padded)
            table[:n, width:].zero_()
            copy_into(slots[:n], inputs.slot_mappings[gid] + [-1] * pad)
        return self.input_ids[:n], self._context(n, seq_lens)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [n, H] of a step from :meth:`prepare`: the captured graph's replay,
        or without capture the eager forward over the same padded views."""
        n = input_ids.shape[0]
        graph = self.graphs.get(n)
        if graph is None:
            return self.model(input_ids, ctx)
        graph.replay()
        return self.outputs[n]

    def _context(self, n: int, seq_lens: list[int]) -> ForwardContext:
        groups = [GroupMetadata(block_size=g.block_size, block_table=table[:n], slot_mapping=slots[:n])
                  for g, table, slots in zip(self.groups, self.block_tables, self.slot_mappings)]
        return ForwardContext(positions=self.positions[:n], query_start_loc=list(range(n + 1)),
                              seq_lens=seq_lens, groups=groups,
                              query_start_loc_t=self.query_start_loc[:n + 1],
                              seq_lens_t=self.seq_lens[:n], token_seq=self.token_seq[:n],
                              max_seq_len=self.max_model_len, decode_only=True)

    # -- capture -------------------------------------------------------------------
    def _capture(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Every row is padding while capturing: the warm-up forwards store nothing.
        self.input_ids.zero_()
        self.positions.zero_()
        self.seq_lens.fill_(1)
        for table, slots in zip(self.block_tables, self.slot_mappings):
            table.zero_()
            slots.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            ids = self.input_ids[:n]
            for _ in range(_WARMUP_RUNS):
                self.model(ids, self._context(n, [1] * n))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # A fresh context: one that a warm-up forward used holds results of that forward
            # (ForwardContext.memo), which the graph must compute itself.
            ctx = self._context(n, [1] * n)
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[n] = self.model(ids, ctx)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode forward of {type(self.model).__name__} at batch size {n} "
                    f"failed ({exc}); its forward must not synchronise with the host in a decode_only "
                    "context (forward_context.py). Run with enforce_eager=True meanwhile") from exc
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
                    len(self.graphs), self.sizes, time.perf_counter() - start, used / 2**20)
