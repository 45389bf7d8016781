"""ModelRunner: StepPlan -> device tensors -> model forward (eager or a decode CUDA
graph) -> sampler -> StepResult.

A step is split in two for overlapped scheduling: ``launch(plan)`` queues the
device work and starts copying the sampled ids and logprobs to pinned host
memory, returning a StepHandle; ``finish(handle)`` waits for it (a CUDA event)
and builds the StepResult. Between the two the host may plan and launch the next
step, whose placeholder tokens are gathered on the device from this step's
sampled ids. The launch path must not wait for the device: host lists go to the
device through deepinfer/transfer.py. On the CPU the split stays (finish only
converts to Python values).

What belongs here: the device state (KV-cache memory, per-request sampling
state and grammar matchers, input tensors, decode graphs), sizing the KV cache
from the memory budget, and turning a plan into a forward. What does not:
scheduling decisions (scheduler/), model math (models/, layers/), sampling math
(runner/sampler.py), and graph capture/replay mechanics (runner/cuda_graph.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from deepinfer.batch_invariant import batch_invariant_mode
from deepinfer.config import EngineConfig
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.kernels import backend
from deepinfer.layers.moe import FusedMoE
from deepinfer.models.base import CausalLM
from deepinfer.parallel.context import shard_step
from deepinfer.parallel.groups import current_groups
from deepinfer.runner.cuda_graph import DecodeGraphs, DraftGraphs, max_blocks_per_seq
from deepinfer.runner.inputs import StepInputs
from deepinfer.runner.kv_offload import KVTierStore, config_fingerprint
from deepinfer.runner.sampler import (
    Sampler,
    SampleTensors,
    SamplingRow,
    prompt_logprobs,
)
from deepinfer.spec.drafter import Drafter, ModelDrafter, StepCommit, make_drafter
from deepinfer.spec.scheduling import SPSTable
from deepinfer.spec.verify import VerifyTensors, verify
from deepinfer.transfer import copy_to_host, to_device
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.kv_cache import KVCacheGroup, page_bytes
from deepinfer.scheduler.kv_tiers import TierEntry
from deepinfer.outputs import PositionLogprobs
from deepinfer.scheduler.plan import (
    PLACEHOLDER_TOKEN_ID,
    SampledToken,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from deepinfer.structured.base import CompiledGrammar, GrammarMatcher
from deepinfer.structured.bitmask import allocate_token_bitmask

logger = logging.getLogger(__name__)

# The most tokens a verification step's CUDA graph holds (B sequences x (1 + drafts) rows).
MAX_VERIFY_GRAPH_TOKENS = 512


def _run_start(values: list[int]) -> int | None:
    """values[0] when ``values`` is a non-empty run of consecutive ints, else None."""
    if values and values[-1] - values[0] == len(values) - 1 and values == list(range(values[0], values[-1] + 1)):
        return values[0]
    return None


def _verification_only(seqs: list[ScheduledSeq]) -> bool:
    """Every sequence feeds its last sampled token and its drafts, and some have drafts: a
    step the decode graphs serve with one row per token."""
    return (any(seq.num_draft for seq in seqs)
            and all(seq.sample and not seq.prompt_logprob_rows and len(seq.token_ids) == 1 + seq.num_draft
                    for seq in seqs))


@dataclass
class _RunnerRequest:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stream_index: int
    # Structured outputs: has accepted every token in output_token_ids. The state lives
    # as long as the request (preemption keeps it), so no token is ever accepted twice.
    matcher: GrammarMatcher | None = None
    replay_start: int = 0      # bounded replay: first position the late layers compute


@dataclass
class StepHandle:
    """A launched step: what ``finish`` needs to build its StepResult."""

    sampled_ids: list[str] = field(default_factory=list)                # req ids of the sampled rows
    sampled_states: list[_RunnerRequest] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)   # slot of each row's token in output_token_ids
    sample: SampleTensors | None = None                  # on the host once ``end`` has completed
    # req_id -> (logits rows [L, V], next prompt tokens, number of top logprobs)
    prompt_logits: dict[str, tuple[torch.Tensor, list[int], int]] = field(default_factory=dict)
    # Speculative decoding: the verified sequences' req ids, states and first row in ``verified``.
    verified_ids: list[str] = field(default_factory=list)
    verified_states: list[_RunnerRequest] = field(default_factory=list)
    verified_offsets: list[int] = field(default_factory=list)
    verified: VerifyTensors | None = None                # on the host once ``end`` has completed
    # A model drafter's proposals: the req ids and their drafts [B, max_draft] (host copy).
    draft_ids: list[str] = field(default_factory=list)
    drafts: torch.Tensor | None = None
    confidences: torch.Tensor | None = None              # [B, max_draft], when the drafter has them
    start: torch.cuda.Event | None = None      # CUDA: before the forward's first kernel
    end: torch.cuda.Event | None = None        # CUDA: after the last copy to the host
    prev_end: torch.cuda.Event | None = None   # CUDA: ``end`` of the step launched before, if measured
    tier_loads: list[Future] = field(default_factory=list)   # KV tier loads (runner/kv_offload.py)
    # Its result, once built: early when the next launch plans a step ahead of this one
    # (``ScheduledSeq.ahead``), and ``finish`` then returns it.
    result: StepResult | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, eos_token_ids: set[int],
                 bounded_replay: bool = False) -> None:
        """``bounded_replay``: the model truncates prompts for its late layers
        (``CausalLM.replay_keep_tokens`` gave a count), so forwards other than
        ``decode_only`` carry each sequence's ``replay_start`` in the context."""
        self.config = config
        self.model = model
        self.bounded_replay = bounded_replay
        # The context-parallel group the model was built under: its ranks share prefill steps
        # (parallel/context.py).
        self.cp_group = current_groups().cp
        self.cp_split_steps = 0         # steps this rank ran its context-parallel share of
        self.device = config.device
        self.dtype = config.model.dtype
        self.sampler = Sampler(vocab_size=config.model.vocab_size, eos_token_ids=eos_token_ids,
                               seed=config.seed, device=self.device)
        self.requests: dict[str, _RunnerRequest] = {}
        self.groups: list[KVCacheGroup] = []
        self.kv_buffer: torch.Tensor | None = None
        self._bitmask: torch.Tensor | None = None     # CPU [rows, ceil(V / 32)] int32, grown on demand
        self.decode_graphs: DecodeGraphs | None = None  # made once the KV cache is bound
        self.draft_graphs: DraftGraphs | None = None    # a graph-safe model drafter's proposals
        self.verify_graph_steps = 0     # verification steps that took the decode graphs' buffers
        self.drafter_graph_steps = 0    # model-drafter steps whose forward replayed a decode graph
        self.kv_tiers: KVTierStore | None = None        # the KV cache's host and disk tiers' bytes
        # The last launch's sampled rows (req_id -> row) and token ids [N] on the device:
        # the next launch's placeholder tokens come from here.
        self._last_sampled: tuple[dict[str, int], torch.Tensor] | None = None
        self._prev_end: torch.cuda.Event | None = None   # CUDA: end event of the last launch
        self._last_handle: StepHandle | None = None      # the last launch that ran a forward
        # Speculative decoding: proposes each sampled sequence's drafts for its next step.
        self.drafter: Drafter | ModelDrafter | None = (None if config.speculative is None
                                                       else make_drafter(config.speculative, model))

    # -- KV cache memory -------------------------------------------------------
    def determine_num_blocks(self, groups: list[KVCacheGroup]) -> int:
        cache = self.config.cache
        page = page_bytes(groups)
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = cache.cpu_kv_cache_bytes
        num_blocks = budget // page
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {page} bytes; "
                "raise gpu_memory_utilization (CUDA) or cpu_kv_cache_bytes (CPU)")
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        """Free memory for the cache: the utilisation target minus the peak that
        weights plus one maximal forward (no cache) reach, minus non-torch usage."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        ids = torch.randint(0, self.config.model.vocab_size, (n,), device=self.device)
        ctx = ForwardContext.no_cache([n], self.device)
        hidden = self.model(ids, ctx)
        rows = min(self.config.scheduler.max_num_seqs, n)
        self.model.compute_logits(hidden[-rows:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        drafts = self._draft_graph_bytes()
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - max(0, non_torch) - drafts
        logger.info("KV cache budget %.2f GiB (peak %.2f GiB, draft graph buffers %.2f GiB, total %.2f GiB)",
                    budget / 2**30, peak / 2**30, drafts / 2**30, total / 2**30)
        torch.cuda.empty_cache()
        return max(0, budget)

    def _draft_graph_bytes(self) -> int:
        """What :class:`DraftGraphs` will allocate after the cache is laid out (its sampling noise,
        [largest bucket, draft slots, vocab] float32, dominates: ~165 MB at B = 64 for a
        129k vocabulary and 5 slots), so the cache budget leaves it room; 0 without one."""
        if not (isinstance(self.drafter, ModelDrafter) and self.graphs_serve_drafter
                and self._why_no_cuda_graphs() is None):
            return 0
        return DraftGraphs.static_bytes(self.drafter, max(self.config.scheduler.graph_batch_sizes), self.dtype)

    def release(self) -> None:
        """Drop the device memory this runner holds (CUDA graphs, the KV cache and its layers'
        views, the model's parameters) and hand the cached blocks back to the driver; the runner
        is not used after (``Engine.close``)."""
        self.decode_graphs = self.draft_graphs = None
        self._last_sampled = self._last_handle = self._prev_end = None
        for layer in self.kv_cache_layers():
            layer.kv_cache = None
        self.kv_buffer = self.kv_tiers = None         # the tiers' store holds the buffer too
        self.drafter = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """One byte buffer of ``num_blocks`` pages; each layer gets a strided view
        ``[num_blocks, block_size, num_tensors, H_kv, row]`` in its spec's dtype into its group's
        part of a page (row: ``head_size`` values, or a packed record's bytes). A group's layers
        with wider elements come first in the page, so each layer's part starts aligned to its
        element size (pages are a multiple of ``PAGE_ALIGN`` bytes). Block copies (forks) copy
        page bytes, whatever the layers' dtypes."""
        layers = self.kv_cache_layers()
        self.kv_buffer = torch.zeros(num_blocks, page_bytes(groups), dtype=torch.uint8, device=self.device)
        for gid, group in enumerate(groups):
            offset = 0
            members = sorted(zip(group.layer_ids, group.specs), key=lambda m: -m[1].dtype.itemsize)
            for layer_id, spec in members:
                n = group.block_size * spec.entry_bytes
                view = self.kv_buffer[:, offset:offset + n].view(spec.dtype).view(
                    num_blocks, group.block_size, spec.num_tensors, spec.num_kv_heads, spec.row_size)
                layers[layer_id].kv_cache = view
                layers[layer_id].group_id = gid
                offset += n
        self.groups = list(groups)
        # Graphs capture the caches' addresses, so they come after the layout.
        reason = self._why_no_cuda_graphs()
        if reason is None:
            self.enable_decode_graphs(capture=True)
        elif self.device.type == "cuda" and not self.config.enforce_eager:
            logger.warning("decode steps run eagerly: %s", reason)
        else:
            logger.info("decode steps run eagerly: %s", reason)

    def enable_kv_tiers(self) -> list[TierEntry]:
        """Keep the KV cache's lower tiers (``CacheConfig.kv_offload_bytes`` / ``kv_disk_*``)
        for the bound cache; returns the entries a disk tier already holds."""
        if self.kv_buffer is None:
            raise RuntimeError("enable_kv_tiers needs the KV cache: call allocate_kv_cache first")
        self.kv_tiers = KVTierStore(self.kv_buffer, self.groups, config_fingerprint(self.config, self.groups),
                                    self.config.cache.kv_disk_dir)
        return self.kv_tiers.scan()

    def read_kv_block(self, group: int, block: int) -> bytes:
        """The bytes of ``group``'s part of page ``block`` (every layer of the group), as the
        lower tiers keep them; on CUDA the copy waits for the work queued before it."""
        return self.kv_block_view(group, block).cpu().numpy().tobytes()

    def kv_block_view(self, group: int, block: int) -> torch.Tensor:
        """``group``'s part of page ``block`` in the device cache (uint8, a view)."""
        if self.kv_buffer is None:
            raise RuntimeError("reading KV blocks needs the KV cache: call allocate_kv_cache first")
        return self.kv_buffer[block, :self.groups[group].bytes_per_block]

    def kv_cache_layers(self) -> list[torch.nn.Module]:
        """The layers that keep entries in the KV cache: the model's, then a model drafter's."""
        layers = list(self.model.kv_cache_layers())
        if isinstance(self.drafter, ModelDrafter):
            layers += self.drafter.kv_cache_layers()
        return layers

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The KV-cache spec of each of :meth:`kv_cache_layers`, in order."""
        return [layer.kv_spec for layer in self.kv_cache_layers()]

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the last token the drafter writes (the scheduler reserves them)."""
        return getattr(self.drafter, "num_lookahead_tokens", 0)

    @property
    def prefix_hit_margin(self) -> int:
        """Positions a prefix-cache hit stops short of, for the drafter to recompute."""
        return getattr(self.drafter, "prefix_hit_margin", 0)

    @property
    def drafts_on_device(self) -> bool:
        """The drafter proposes on the device inside the step (a model drafter), so the next
        speculative step may be planned before this one's drafts reach the host."""
        return isinstance(self.drafter, ModelDrafter)

    @property
    def drafter_has_confidences(self) -> bool:
        """The drafter reports draft confidences (varlen verification needs them)."""
        return isinstance(self.drafter, ModelDrafter) and self.drafter.has_confidences

    @torch.inference_mode()
    def profile_steps_per_second(self, sizes: list[int], seq_len: int, repeats: int = 3) -> SPSTable:
        """The target's forward rate at each token batch size in ``sizes``: batches of
        sequences of ``seq_len`` new tokens (a verification's shape; the last one shorter),
        without a KV cache, the median of ``repeats`` timed forwards after one untimed."""
        points = []
        for n in sizes:
            lens = [seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else [])
            ids = torch.randint(0, self.config.model.vocab_size, (n,), device=self.device)
            times = []
            for i in range(repeats + 1):
                ctx = ForwardContext.no_cache(lens, self.device)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                self.model.compute_logits(self.model(ids, ctx)[-len(lens):])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if i:
                    times.append(time.perf_counter() - t0)
            points.append((n, 1.0 / statistics.median(times)))
        return SPSTable(tuple(points))

    # -- CUDA graphs -------------------------------------------------------------
    def _why_no_cuda_graphs(self) -> str | None:
        """Why decode steps may not be captured in CUDA graphs, or None when they may."""
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device (device={self.device})"
        if not self.model.supports_cuda_graphs:
            return (f"{type(self.model).__name__} does not declare supports_cuda_graphs (its decode "
                    "forward may synchronise with the host)")
        if any(isinstance(m, FusedMoE) and m.ep is not None for m in self.model.modules()):
            return "expert-parallel MoE layers read their dispatch sizes on the host (parallel/expert.py)"
        if not backend.use_triton(torch.empty(0, device=self.device)):
            return ("the kernel backend is torch (DEEPINFER_KERNEL_BACKEND): the reference kernels "
                    "synchronise with the host")
        return None

    @property
    def graphs_serve_drafter(self) -> bool:
        """The decode graphs serve this engine's speculative steps: no drafter, a host drafter
        (n-gram), or a model drafter that declares ``graph_safe`` (and ``speculative_config``
        leaves ``cuda_graphs`` on), whose forward and proposal the graphs then hold."""
        if not isinstance(self.drafter, ModelDrafter):
            return True
        return self.drafter.graph_safe and self.config.speculative.cuda_graphs

    def enable_decode_graphs(self, capture: bool) -> None:
        """Route decode steps that fit a bucket (``scheduler.graph_batch_sizes``) through static,
        padded input buffers; with ``capture`` (CUDA) each bucket's forward is captured now and
        replayed, without it the padded forward runs eagerly (tests check padding that way).
        With a graph-safe model drafter the buckets hold its forward (the target's and what it
        keeps) and its proposal gets :class:`DraftGraphs` of the decode buckets."""
        if self.kv_buffer is None:
            raise RuntimeError("enable_decode_graphs needs the KV cache: call allocate_kv_cache first")
        drafter = self.drafter if isinstance(self.drafter, ModelDrafter) and self.graphs_serve_drafter else None

        def drafter_forward(input_ids: torch.Tensor, ctx: ForwardContext) -> tuple:
            return drafter.forward(self.model, input_ids, ctx, lambda t: t)

        forward = drafter_forward if drafter is not None else None
        after = drafter.context_pass if drafter is not None and drafter.has_context_pass else None
        max_len = self.config.model.max_model_len
        # Batch-invariant mode: the graphs must hold the invariant kernels the eager steps run,
        # so they are captured with the mode on (the steps replay them with it on too).
        with batch_invariant_mode() if self.config.batch_invariant else contextlib.nullcontext():
            self.decode_graphs = DecodeGraphs(self.model, self.groups, self._graph_sizes(), max_len, self.device,
                                              capture, forward=forward, after=after)
            if drafter is not None:
                group = self.groups[drafter.kv_cache_layers()[0].group_id]
                self.draft_graphs = DraftGraphs(drafter, self.decode_graphs,
                                                self.config.scheduler.graph_batch_sizes,
                                                max_blocks_per_seq(group, max_len), max_len + drafter.max_draft,
                                                self.dtype, self.device, capture)

    def _graph_sizes(self) -> list[int]:
        """Decode buckets (``scheduler.graph_batch_sizes``) and, with a drafter whose steps the
        graphs serve (:attr:`graphs_serve_drafter`), the token counts of verification steps:
        each decode bucket times 1 + the draft length, up to the step's token budget and
        ``MAX_VERIFY_GRAPH_TOKENS`` (varlen steps pad to the next)."""
        sizes = set(self.config.scheduler.graph_batch_sizes)
        spec = self.config.speculative
        if spec is not None and self.graphs_serve_drafter:
            cap = min(self.config.scheduler.max_num_batched_tokens, MAX_VERIFY_GRAPH_TOKENS)
            width = 1 + spec.num_speculative_tokens
            sizes |= {n * width for n in sizes if n * width <= cap}
        return sorted(sizes)

    # -- one step ----------------------------------------------------------------
    # A step is launched (inputs, forward, sampling queued on the device; the sampled ids
    # and logprobs start copying to pinned host memory) and later finished (wait, then
    # build the StepResult). The engine may launch step N+1 before finishing step N:
    # step N+1's placeholder tokens are gathered on the device from step N's sampled ids.
    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.remove(req_id)
        for new in plan.new_requests:
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids), list(new.output_token_ids), new.params, new.stream_index,
                self._new_matcher(new.grammar, new.output_token_ids) if new.grammar is not None else None,
                new.replay_start)
        handle = StepHandle()
        if plan.kv_tier_ops:
            # Saves first: the copies and the forward below may overwrite evicted blocks.
            handle.tier_loads = self.kv_tiers.execute(plan.kv_tier_ops)
        for src, dst in plan.block_copies:
            self.kv_buffer[dst].copy_(self.kv_buffer[src])
        if plan.is_empty:
            return handle

        if any(seq.ahead for seq in plan.seqs):
            plan = self._resolve_ahead(plan)
        with record_function("deepinfer.prepare"):
            input_ids, ctx, starts = self._prepare(plan.seqs)
            self._fill_placeholders(input_ids, starts, plan.seqs)
        if self.device.type == "cuda":
            handle.start, handle.prev_end = torch.cuda.Event(enable_timing=True), self._prev_end
            handle.start.record()
        # Rows whose logits are needed: prompt-logprob rows, then per sampled sequence its last
        # row, or with draft tokens the rows of its last sampled token and of every draft.
        rows: list[int] = []
        for seq, start in zip(plan.seqs, starts):
            rows.extend(range(start, start + seq.prompt_logprob_rows))
            if seq.sample:
                end = start + len(seq.token_ids)
                rows.extend(range(end - 1 - seq.num_draft, end))
        drafting = self.drafter if isinstance(self.drafter, ModelDrafter) else None
        graphed = self.decode_graphs is not None and self.decode_graphs.holds(input_ids)
        with record_function("deepinfer.forward"):
            if drafting is None:
                hidden = self._forward(input_ids, ctx, rows)                  # [N, H]
            elif graphed:
                # The bucket's graph holds the drafter's forward (every row; the state read at once).
                self.drafter_graph_steps += 1
                hidden, draft_state = self.decode_graphs.run(input_ids, ctx)
                hidden = self._select(hidden, rows)
            else:
                # The drafter runs the target's forward: it keeps what it reads of it.
                hidden, draft_state = drafting.forward(self.model, input_ids, ctx,
                                                       lambda t: self._select(t, rows))
        self._last_sampled = None
        committed = None
        if rows:
            with record_function("deepinfer.sample"):
                logits = self.model.compute_logits(hidden)                      # [N, V]
                committed = self._launch_sampling(plan, logits, handle)
        if drafting is not None:
            # Every step, even one that committed nothing (a prompt chunk): a drafter may keep
            # rows of every position (the MTP layer's KV needs each row's next token).
            with record_function("deepinfer.draft"):
                commit = self._step_commit(plan, input_ids, starts, graphed, handle, *(committed or (None, None)))
                drafts = drafting.propose(draft_state, commit, ctx, self.sampler.generator,
                                          graphs=self.draft_graphs if graphed else None)
                if commit.req_ids:
                    handle.draft_ids = commit.req_ids
                    handle.drafts = copy_to_host(drafts)
                    confidence = drafting.confidences()
                    handle.confidences = None if confidence is None else copy_to_host(confidence)
        if self.device.type == "cuda":
            handle.end = torch.cuda.Event(enable_timing=True)
            handle.end.record()
            self._prev_end = handle.end
        self._last_handle = handle
        return handle

    def _resolve_ahead(self, plan: StepPlan) -> StepPlan:
        """``plan`` with its planned-ahead sequences (``ScheduledSeq.ahead``) made concrete from
        the previous launch's result, built now (a wait for that step's device work): each
        starts at its last committed token and verifies the drafts that step proposed, up to
        the number planned. The scheduler makes the same sequences when that step lands."""
        prev = self._last_handle
        if prev is None:
            raise RuntimeError("a plan was made ahead of a step, but no step was launched before it")
        if prev.result is None:
            prev.result = self._finish(prev)
        seqs = []
        for seq in plan.seqs:
            if seq.ahead:
                state = self.requests[seq.req_id]
                drafts = prev.result.draft_token_ids.get(seq.req_id, [])[:seq.num_draft]
                seq = dataclasses.replace(
                    seq, start_pos=len(state.prompt_token_ids) + len(state.output_token_ids) - 1,
                    token_ids=[state.output_token_ids[-1], *drafts], num_draft=len(drafts),
                    placeholder=False, ahead=False)
            seqs.append(seq)
        return dataclasses.replace(plan, seqs=seqs)

    def _launch_sampling(self, plan: StepPlan, logits: torch.Tensor, handle: StepHandle
                         ) -> tuple[torch.Tensor | None, VerifyTensors | None] | None:
        """Queue the sampler on ``logits`` ([N, V]: prompt-logprob rows, then per sampled
        sequence its one row, or its 1 + num_draft verification rows) and start copying its
        result to the host. Returns the sampled rows' tokens and the verification's result on
        the device (None where there are none), or None when nothing was sampled."""
        sample_rows: list[int] = []
        sampling_rows: list[SamplingRow] = []
        verify_rows: list[int] = []
        verify_sampling: list[SamplingRow] = []
        num_draft: list[int] = []
        draft_ids: list[list[int]] = []
        r = 0
        for seq in plan.seqs:
            if seq.prompt_logprob_rows:
                state = self.requests[seq.req_id]
                nxt = state.prompt_token_ids[seq.start_pos + 1: seq.start_pos + 1 + seq.prompt_logprob_rows]
                handle.prompt_logits[seq.req_id] = (logits[r:r + seq.prompt_logprob_rows], nxt,
                                                    state.params.prompt_logprobs)
                r += seq.prompt_logprob_rows
            if seq.num_draft:
                state = self.requests[seq.req_id]
                drafts = seq.token_ids[-seq.num_draft:]
                handle.verified_ids.append(seq.req_id)
                handle.verified_states.append(state)
                handle.verified_offsets.append(len(verify_rows))
                num_draft.append(seq.num_draft)
                draft_ids.append(drafts)
                # Row j sees drafts 0..j-1 as output: penalties, min_tokens, seeds and the
                # grammar (its matcher advanced over them) count them.
                for j in range(seq.num_draft + 1):
                    verify_rows.append(r + j)
                    verify_sampling.append(SamplingRow(state.params, state.prompt_token_ids,
                                                       state.output_token_ids + drafts[:j], state.stream_index,
                                                       grammar=state.matcher is not None))
                r += seq.num_draft + 1
            elif seq.sample:
                for req_id in [seq.req_id, *seq.fork_ids]:
                    state = self.requests[req_id]
                    sample_rows.append(r)
                    handle.sampled_ids.append(req_id)
                    handle.sampled_states.append(state)
                    sampling_rows.append(SamplingRow(state.params, state.prompt_token_ids,
                                                     state.output_token_ids, state.stream_index,
                                                     grammar=state.matcher is not None))
                r += 1
        if verify_rows:
            probs = None
            if isinstance(self.drafter, ModelDrafter):
                probs = [self.drafter.draft_probs(req_id) for req_id in handle.verified_ids]
            verified = verify(self.sampler, self._select(logits, verify_rows), verify_sampling,
                              num_draft, draft_ids, probs, self._verification_bitmask(handle.verified_states, draft_ids))
            handle.verified = verified.to_host()
        else:
            verified = None
        if not sample_rows:
            return None if verified is None else (None, verified)
        out = self.sampler.sample(self._select(logits, sample_rows), sampling_rows,
                                  self._token_bitmask(handle.sampled_states))
        # The sampler has read the output lengths (seeds, min_tokens); hold each token's slot
        # until finish() knows its value.
        for state in handle.sampled_states:
            handle.positions.append(len(state.output_token_ids))
            state.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self._last_sampled = ({req_id: i for i, req_id in enumerate(handle.sampled_ids)}, out.token_ids)
        handle.sample = out.to_host()
        return out.token_ids, verified

    def _step_commit(self, plan: StepPlan, input_ids: torch.Tensor, starts: list[int], per_token: bool,
                     handle: StepHandle, sampled: torch.Tensor | None, verified: VerifyTensors | None) -> StepCommit:
        """What the step committed, on the device (no host sync), for a model drafter: every
        sequence that got a token (the sampled ones, fork siblings included, then the
        verified ones; none in a step of prompt chunks only), the row of its last committed
        position and the token after it, and for every row the token at its position + 1
        where the step knows it. ``starts``: where each sequence's tokens start in the
        flattened batch; ``per_token``: the context has a row per token (a decode graph's
        buffers), so a sequence's block-table row is that of its first token."""
        row_of = {seq.req_id: b for b, seq in enumerate(plan.seqs)}
        parent_of = {child: seq.req_id for seq in plan.seqs for child in seq.fork_ids}
        q = starts
        # Within a sequence, row i's next token is row i + 1's input; a chunk that does not
        # reach the end of the known tokens ends on the next prompt token.
        next_ids = torch.cat([input_ids[1:], input_ids[:1]])                              # [T]
        tail_rows, tail_ids = [], []
        for b, seq in enumerate(plan.seqs):
            if not seq.sample:
                state = self.requests[seq.req_id]
                known = state.prompt_token_ids + state.output_token_ids
                tail_rows.append(q[b + 1] - 1)
                tail_ids.append(known[seq.start_pos + len(seq.token_ids)])
        if tail_rows:
            next_ids[self._indices(tail_rows)] = self._indices(tail_ids)
        last_rows, anchors = [], []
        if sampled is not None:
            # One token each, after the last row fed (a fork sibling's row is its parent's).
            rows = self._indices([q[row_of[parent_of.get(r, r)] + 1] - 1 for r in handle.sampled_ids])
            own = [i for i, r in enumerate(handle.sampled_ids) if r not in parent_of]
            next_ids[rows[own]] = sampled[own]
            last_rows.append(rows)
            anchors.append(sampled)
        if verified is not None:
            # Row j of a verified sequence is followed by its committed token j; its last committed
            # position is row num_tokens - 1, followed by the target's own token.
            first = [q[row_of[r]] for r in handle.verified_ids]
            spans = [(first[i], handle.verified_offsets[i], seq_len) for i, seq_len in
                     enumerate(len(plan.seqs[row_of[r]].token_ids) for r in handle.verified_ids)]
            dst = self._indices([f + j for f, _, n in spans for j in range(n)])
            src = self._indices([o + j for _, o, n in spans for j in range(n)])
            next_ids[dst] = verified.rows.token_ids[src]
            last = self._indices(first) + verified.num_tokens - 1
            last_rows.append(last)
            anchors.append(verified.rows.token_ids[self._indices(handle.verified_offsets) + verified.num_tokens - 1])
        req_ids = handle.sampled_ids + handle.verified_ids
        states = [self.requests[r] for r in req_ids]
        if not req_ids:                                                                   # nothing committed
            last_rows = anchors = [torch.empty(0, dtype=torch.long, device=self.device)]
        return StepCommit(req_ids=req_ids, params=[st.params for st in states],
                          stream_indices=[st.stream_index for st in states],
                          prompt_lens=[len(st.prompt_token_ids) for st in states],
                          table_rows=[q[row_of[parent_of.get(r, r)]] if per_token else row_of[parent_of.get(r, r)]
                                      for r in req_ids],
                          last_rows=torch.cat(last_rows), anchors=torch.cat(anchors), next_ids=next_ids)

    def _fill_placeholders(self, input_ids: torch.Tensor, query_start_loc: list[int],
                           seqs: list[ScheduledSeq]) -> None:
        """Write into ``input_ids`` ([T], in place) the tokens the previous launch sampled for
        sequences fed a placeholder: a gather on the device, no host round trip."""
        dst = [query_start_loc[b + 1] - 1 for b, seq in enumerate(seqs) if seq.placeholder]
        if not dst:
            return
        if self._last_sampled is None:
            raise RuntimeError("a plan feeds placeholder tokens but the previous step sampled nothing")
        index, tokens = self._last_sampled
        missing = [seq.req_id for seq in seqs if seq.placeholder and seq.req_id not in index]
        if missing:
            raise RuntimeError(f"placeholder tokens for {missing}, which the previous step did not sample")
        src = [index[seq.req_id] for seq in seqs if seq.placeholder]
        if _run_start(dst) is not None and _run_start(src) is not None:    # decode: row b <- row b
            input_ids[dst[0]:dst[0] + len(dst)].copy_(tokens[src[0]:src[0] + len(src)])
            return
        input_ids.index_copy_(0, self._indices(dst), tokens.index_select(0, self._indices(src)))

    @torch.inference_mode()
    def finish(self, handle: StepHandle) -> StepResult:
        """Wait for a launched step and build its result."""
        with record_function("deepinfer.finish"):
            return self._finish(handle)

    def _finish(self, handle: StepHandle) -> StepResult:
        if handle.result is not None:
            return handle.result
        result = StepResult()
        if handle.tier_loads:
            result.kv_load_failures = self.kv_tiers.wait(handle.tier_loads)
        if handle.end is not None:
            handle.end.synchronize()
            result.gpu_busy_ms = handle.start.elapsed_time(handle.end)
            if handle.prev_end is not None:
                result.gpu_idle_ms = handle.prev_end.elapsed_time(handle.start)
        for req_id, (logits, nxt, num) in handle.prompt_logits.items():
            result.prompt_logprobs[req_id] = prompt_logprobs(logits, nxt, num,
                                                             vocab_size=self.config.model.vocab_size)
        if handle.sample is not None:
            out = handle.sample.output()
            for i, (req_id, state) in enumerate(zip(handle.sampled_ids, handle.sampled_states)):
                token = out.token_ids[i]
                state.output_token_ids[handle.positions[i]] = token
                result.sampled[req_id] = self._accept(state, token, out.sampled_logprobs[i], out.logprobs[i])
        if handle.verified is not None:
            self._finish_verified(handle, result)
        if handle.drafts is not None:
            confidences = None if handle.confidences is None else handle.confidences.tolist()
            for i, (req_id, drafts) in enumerate(zip(handle.draft_ids, handle.drafts.tolist())):
                tok = result.sampled.get(req_id)
                if tok is None or tok.error is not None or tok.grammar_terminated:
                    continue
                matcher = self.requests[req_id].matcher
                if matcher is not None:
                    drafts = self._grammar_prefix(matcher, drafts)
                if drafts:
                    result.draft_token_ids[req_id] = drafts
                    if confidences is not None:
                        result.draft_confidences[req_id] = confidences[i][:len(drafts)]
        elif isinstance(self.drafter, Drafter):
            self._propose(result)
        handle.result = result
        return result

    @staticmethod
    def _accept(state: _RunnerRequest, token: int, logprob: float,
                top_logprobs: PositionLogprobs | None) -> SampledToken:
        """A sampled token as the scheduler takes it, its grammar (if any) advanced over it."""
        sampled = SampledToken(token, logprob, top_logprobs)
        if state.matcher is not None:
            if not state.matcher.accept_token(token):
                sampled.error = f"structured outputs: the grammar refused sampled token {token}"
            sampled.grammar_terminated = state.matcher.is_terminated()
        return sampled

    def _finish_verified(self, handle: StepHandle, result: StepResult) -> None:
        """Each verified sequence's committed tokens: its accepted drafts, then the target's."""
        out = handle.verified.rows.output()
        num_tokens = handle.verified.num_tokens.tolist()
        for req_id, state, first, n in zip(handle.verified_ids, handle.verified_states,
                                           handle.verified_offsets, num_tokens):
            tokens = [self._accept(state, out.token_ids[first + j], out.sampled_logprobs[first + j],
                                   out.logprobs[first + j]) for j in range(n)]
            state.output_token_ids.extend(t.token_id for t in tokens)
            result.accepted[req_id] = tokens[:-1]
            result.sampled[req_id] = tokens[-1]

    def _propose(self, result: StepResult) -> None:
        """Drafts for every sequence that got a token, for its next step (with a grammar: the
        prefix of them it accepts)."""
        for req_id, tok in result.sampled.items():
            state = self.requests.get(req_id)
            if state is None or tok.error is not None or tok.grammar_terminated:
                continue
            drafts = self.drafter.propose(req_id, state.prompt_token_ids + state.output_token_ids)
            if state.matcher is not None:
                drafts = self._grammar_prefix(state.matcher, drafts)
            if drafts:
                result.draft_token_ids[req_id] = drafts

    def reset_idle_clock(self) -> None:
        """The engine went idle: the next step's device idle time is not measured."""
        self._prev_end = None

    def _indices(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    def _select(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``t[rows]``: a view when the rows are consecutive (a decode step's) or none, else a gather."""
        if not rows:
            return t[:0]
        first = _run_start(rows)
        if first is not None:
            return t[first:first + len(rows)]
        return t.index_select(0, self._indices(rows))

    @staticmethod
    def _new_matcher(grammar: CompiledGrammar, output_token_ids: list[int]) -> GrammarMatcher:
        """A matcher that has accepted the tokens the sequence already generated."""
        matcher = grammar.new_matcher()
        for tok in output_token_ids:
            if not matcher.accept_token(tok):
                raise RuntimeError(f"structured outputs: the grammar refused already generated token {tok}")
        return matcher

    def _verification_bitmask(self, states: list[_RunnerRequest], drafts: list[list[int]]) -> torch.Tensor | None:
        """The token bitmask of a verification's rows on the device (sequence r's rows
        1 + len(drafts[r]); row j: its grammar after drafts 0..j-1, which the matcher accepts
        and then rolls back), or None when no sequence has a grammar."""
        if all(st.matcher is None for st in states):
            return None
        rows = sum(len(d) + 1 for d in drafts)
        bitmask = allocate_token_bitmask(rows, self.config.model.vocab_size)
        r = 0
        for state, seq_drafts in zip(states, drafts):
            matcher = state.matcher
            if matcher is not None:
                for j in range(len(seq_drafts) + 1):
                    matcher.fill_bitmask(bitmask, r + j)
                    if j < len(seq_drafts) and not matcher.accept_token(seq_drafts[j]):
                        raise RuntimeError(f"structured outputs: draft token {seq_drafts[j]} was checked "
                                           "against the grammar when proposed but is refused now")
                matcher.rollback(len(seq_drafts))
            r += len(seq_drafts) + 1
        return bitmask.to(self.device)

    @staticmethod
    def _grammar_prefix(matcher: GrammarMatcher, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts (the matcher is left as it was)."""
        n = 0
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
        matcher.rollback(n)
        return drafts[:n]

    def _token_bitmask(self, states: list[_RunnerRequest]) -> torch.Tensor | None:
        """The token bitmask of the sampled rows on the device ([N, ceil(V / 32)] int32), or
        None when no row has a grammar. Rows without a grammar hold stale words the sampler
        never reads."""
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if not constrained:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(states):
            self._bitmask = allocate_token_bitmask(max(len(states), self.config.scheduler.max_num_seqs),
                                                   self.config.model.vocab_size)
        for i in constrained:
            states[i].matcher.fill_bitmask(self._bitmask, i)
        return self._bitmask[:len(states)].to(self.device)

    def _prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Input ids [T], the forward context of a step, and where each sequence's tokens start
        in the flattened batch ([B+1]). A decode step that a graph bucket holds gets views of
        the decode graphs' static buffers, padded to the bucket's size (T = bucket; rows past
        the step's tokens are padding, see runner/cuda_graph.py); so does a verification step,
        each token its own row (:meth:`StepInputs.per_token`)."""
        inputs = StepInputs.build(seqs, self.groups)
        starts = inputs.query_start_loc
        graphs = self.decode_graphs
        if graphs is not None and self.graphs_serve_drafter:
            if inputs.decode_only and graphs.bucket_for(inputs.num_seqs) is not None:
                return (*graphs.prepare(inputs), starts)
            if _verification_only(seqs) and graphs.bucket_for(len(inputs.input_ids)) is not None:
                self.verify_graph_steps += 1
                return (*graphs.prepare(inputs.per_token()), starts)
        groups = []
        for group, tables, slots in zip(self.groups, inputs.block_tables, inputs.slot_mappings):
            width = max(1, max(len(t) for t in tables))
            padded = [t + [0] * (width - len(t)) for t in tables]
            groups.append(GroupMetadata(
                block_size=group.block_size,
                block_table=to_device(padded, torch.int32, self.device),
                slot_mapping=to_device(slots, torch.long, self.device)))
        # Batch-invariant mode runs decode steps through the general path too, so a token's
        # bits do not depend on whether it was a step's only token (a decode, or a verification
        # that kept no draft) or one of several (a chunk, a verification).
        decode_only = inputs.decode_only and not self.config.batch_invariant
        replay_starts = None
        if self.bounded_replay and not decode_only:
            replay_starts = [self.requests[seq.req_id].replay_start for seq in seqs]
        ctx = ForwardContext(positions=to_device(inputs.positions, torch.long, self.device),
                             query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
                             groups=groups, decode_only=decode_only,
                             query_start_loc_t=to_device(inputs.query_start_loc, torch.int32, self.device),
                             seq_lens_t=to_device(inputs.seq_lens, torch.int32, self.device),
                             token_seq=to_device(inputs.token_seq, torch.int32, self.device),
                             replay_starts=replay_starts)
        return to_device(inputs.input_ids, torch.long, self.device), ctx, starts

    def _forward(self, input_ids: torch.Tensor, ctx: ForwardContext, rows: list[int]) -> torch.Tensor:
        """Hidden states [N, H] of ``rows``: a decode graph's replay when ``_prepare`` gave its
        static buffers, the eager forward otherwise (where the model may run its last per-token
        layers on those rows only: :meth:`CausalLM.forward_rows`)."""
        if self.decode_graphs is not None and self.decode_graphs.holds(input_ids):
            out = self.decode_graphs.run(input_ids, ctx)
            # Graphs that hold a model drafter's forward (the drafter switched off meanwhile,
            # as benchmarks do): its hidden states, the drafter's rows written as every step.
            return self._select(out[0] if isinstance(out, tuple) else out, rows)
        # Context parallelism: this rank runs its share of a prefill step; the rows asked for
        # come back from the ranks that computed them.
        split = shard_step(input_ids, ctx, self.cp_group)
        if split is not None:
            local_ids, local_ctx, shard = split
            self.cp_split_steps += 1
            return shard.gather_rows(self.model(local_ids, local_ctx), rows)
        return self.model.forward_rows(input_ids, ctx, lambda t: self._select(t, rows))
