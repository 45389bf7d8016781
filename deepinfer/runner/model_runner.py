"""ModelRunner: StepPlan -> device tensors -> model forward (eager or a decode CUDA
graph) -> sampler -> StepResult.

What belongs here: the device state (KV-cache memory, per-request sampling
state and grammar matchers, input tensors, decode graphs), sizing the KV cache
from the memory budget, and turning a plan into a forward. What does not:
scheduling decisions (scheduler/), model math (models/, layers/), sampling math
(runner/sampler.py), and graph capture/replay mechanics (runner/cuda_graph.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import backend
from deepinfer.models.base import CausalLM
from deepinfer.runner.cuda_graph import DecodeGraphs
from deepinfer.runner.inputs import StepInputs
from deepinfer.runner.sampler import Sampler, SamplingRow, prompt_logprobs
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.kv_cache import KVCacheGroup, page_bytes
from deepinfer.scheduler.plan import SampledToken, ScheduledSeq, StepPlan, StepResult
from deepinfer.structured.base import CompiledGrammar, GrammarMatcher
from deepinfer.structured.bitmask import allocate_token_bitmask

logger = logging.getLogger(__name__)


@dataclass
class _RunnerRequest:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stream_index: int
    # Structured outputs: has accepted every token in output_token_ids. The state lives
    # as long as the request (preemption keeps it), so no token is ever accepted twice.
    matcher: GrammarMatcher | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, eos_token_ids: set[int]) -> None:
        self.config = config
        self.model = model
        self.device = config.device
        self.dtype = config.model.dtype
        self.sampler = Sampler(vocab_size=config.model.vocab_size, eos_token_ids=eos_token_ids,
                               seed=config.seed, device=self.device)
        self.requests: dict[str, _RunnerRequest] = {}
        self.groups: list[KVCacheGroup] = []
        self.kv_buffer: torch.Tensor | None = None
        self._bitmask: torch.Tensor | None = None     # CPU [rows, ceil(V / 32)] int32, grown on demand
        self.decode_graphs: DecodeGraphs | None = None  # made once the KV cache is bound

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
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - max(0, non_torch)
        logger.info("KV cache budget %.2f GiB (peak %.2f GiB, total %.2f GiB)",
                    budget / 2**30, peak / 2**30, total / 2**30)
        torch.cuda.empty_cache()
        return max(0, budget)

    def allocate_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        """One buffer of ``num_blocks`` pages; each layer gets a strided view
        ``[num_blocks, block_size, num_tensors, H_kv, D]`` into its group's part of a page."""
        layers = self.model.kv_cache_layers()
        dtypes = {s.dtype for g in groups for s in g.specs}
        if len(dtypes) != 1:
            raise NotImplementedError(f"KV caches of mixed dtypes {dtypes} are not supported yet")
        dtype = dtypes.pop()
        elem = torch.empty((), dtype=dtype).element_size()
        page_elems = page_bytes(groups) // elem
        self.kv_buffer = torch.zeros(num_blocks, page_elems, dtype=dtype, device=self.device)
        for gid, group in enumerate(groups):
            offset = 0
            for layer_id, spec in zip(group.layer_ids, group.specs):
                n = group.block_size * spec.entry_numel
                view = self.kv_buffer[:, offset:offset + n].view(
                    num_blocks, group.block_size, spec.num_tensors, spec.num_kv_heads, spec.head_size)
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
        if not backend.use_triton(torch.empty(0, device=self.device)):
            return ("the kernel backend is torch (DEEPINFER_KERNEL_BACKEND): the reference kernels "
                    "synchronise with the host")
        return None

    def enable_decode_graphs(self, capture: bool) -> None:
        """Route decode steps that fit a bucket (``scheduler.graph_batch_sizes``) through static,
        padded input buffers; with ``capture`` (CUDA) each bucket's forward is captured now and
        replayed, without it the padded forward runs eagerly (tests check padding that way)."""
        if self.kv_buffer is None:
            raise RuntimeError("enable_decode_graphs needs the KV cache: call allocate_kv_cache first")
        self.decode_graphs = DecodeGraphs(self.model, self.groups, self.config.scheduler.graph_batch_sizes,
                                          self.config.model.max_model_len, self.device, capture)

    # -- one step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_requests:
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids), list(new.output_token_ids), new.params, new.stream_index,
                self._new_matcher(new.grammar, new.output_token_ids) if new.grammar is not None else None)
        for src, dst in plan.block_copies:
            self.kv_buffer[dst].copy_(self.kv_buffer[src])
        if plan.is_empty:
            return StepResult()

        input_ids, ctx = self._prepare(plan.seqs)
        hidden = self._forward(input_ids, ctx)                            # [T, H]

        # Rows whose logits are needed: prompt-logprob rows, then one row per sampled sequence.
        rows: list[int] = []
        for seq, start in zip(plan.seqs, ctx.query_start_loc):
            rows.extend(range(start, start + seq.prompt_logprob_rows))
            if seq.sample:
                rows.append(start + len(seq.token_ids) - 1)
        if not rows:
            return StepResult()
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])  # [N, V]

        result = StepResult()
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        sample_states: list[_RunnerRequest] = []
        sampling_rows: list[SamplingRow] = []
        r = 0
        for seq in plan.seqs:
            if seq.prompt_logprob_rows:
                state = self.requests[seq.req_id]
                nxt = state.prompt_token_ids[seq.start_pos + 1: seq.start_pos + 1 + seq.prompt_logprob_rows]
                result.prompt_logprobs[seq.req_id] = prompt_logprobs(
                    logits[r:r + seq.prompt_logprob_rows], nxt, state.params.prompt_logprobs,
                    vocab_size=self.config.model.vocab_size)
                r += seq.prompt_logprob_rows
            if seq.sample:
                for req_id in [seq.req_id, *seq.fork_ids]:
                    state = self.requests[req_id]
                    sample_rows.append(r)
                    sample_ids.append(req_id)
                    sample_states.append(state)
                    sampling_rows.append(SamplingRow(state.params, state.prompt_token_ids,
                                                     state.output_token_ids, state.stream_index,
                                                     grammar=state.matcher is not None))
                r += 1
        if sample_rows:
            out = self.sampler(logits[torch.tensor(sample_rows, device=self.device)], sampling_rows,
                               self._token_bitmask(sample_states))
            for i, (req_id, state) in enumerate(zip(sample_ids, sample_states)):
                token = out.token_ids[i]
                state.output_token_ids.append(token)
                sampled = SampledToken(token, out.sampled_logprobs[i], out.logprobs[i])
                if state.matcher is not None:
                    if not state.matcher.accept_token(token):
                        sampled.error = f"structured outputs: the grammar refused sampled token {token}"
                    sampled.grammar_terminated = state.matcher.is_terminated()
                result.sampled[req_id] = sampled
        return result

    @staticmethod
    def _new_matcher(grammar: CompiledGrammar, output_token_ids: list[int]) -> GrammarMatcher:
        """A matcher that has accepted the tokens the sequence already generated."""
        matcher = grammar.new_matcher()
        for tok in output_token_ids:
            if not matcher.accept_token(tok):
                raise RuntimeError(f"structured outputs: the grammar refused already generated token {tok}")
        return matcher

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

    def _prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, ForwardContext]:
        """Input ids [T] and the forward context of a step. A decode step that a graph bucket
        holds gets views of the decode graphs' static buffers, padded to the bucket's size
        (T = bucket; rows past len(seqs) are padding, see runner/cuda_graph.py)."""
        inputs = StepInputs.build(seqs, self.groups)
        graphs = self.decode_graphs
        if graphs is not None and inputs.decode_only and graphs.bucket_for(inputs.num_seqs) is not None:
            return graphs.prepare(inputs)
        groups = []
        for group, tables, slots in zip(self.groups, inputs.block_tables, inputs.slot_mappings):
            width = max(1, max(len(t) for t in tables))
            padded = [t + [0] * (width - len(t)) for t in tables]
            groups.append(GroupMetadata(
                block_size=group.block_size,
                block_table=torch.tensor(padded, dtype=torch.int32, device=self.device),
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device)))
        ctx = ForwardContext(positions=torch.tensor(inputs.positions, dtype=torch.long, device=self.device),
                             query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
                             groups=groups, decode_only=inputs.decode_only)
        return torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device), ctx

    def _forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, H]: a decode graph's replay when ``_prepare`` gave its static
        buffers, the eager forward otherwise."""
        if self.decode_graphs is not None and self.decode_graphs.holds(input_ids):
            return self.decode_graphs.run(input_ids, ctx)
        return self.model(input_ids, ctx)
