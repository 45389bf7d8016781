"""ModelRunner: StepPlan -> device tensors -> model forward -> sampler -> StepResult.

What belongs here: the device state (KV-cache memory, per-request sampling
state and grammar matchers, input tensors), sizing the KV cache from the memory
budget, and turning a plan into a forward. What does not: scheduling decisions (scheduler/),
model math (models/, layers/), and sampling math (runner/sampler.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.models.base import CausalLM
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
        hidden = self.model(input_ids, ctx)                               # [T, H]

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
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens = []
        for seq in seqs:
            n = len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            starts.append(starts[-1] + n)
            seq_lens.append(seq.start_pos + n)
        groups = []
        for gid, group in enumerate(self.groups):
            tables = [seq.block_tables[gid] for seq in seqs]
            width = max(1, max(len(t) for t in tables))
            padded = [t + [0] * (width - len(t)) for t in tables]
            slots = []
            bs, ratio = group.block_size, group.compress_ratio
            for seq, table in zip(seqs, tables):
                for p in range(seq.start_pos, seq.start_pos + len(seq.token_ids)):
                    if ratio == 1:
                        slots.append(table[p // bs] * bs + p % bs)
                    elif (p + 1) % ratio == 0:
                        e = (p + 1) // ratio - 1       # this token completes compressed entry e
                        slots.append(table[e // bs] * bs + e % bs)
                    else:
                        slots.append(-1)
            groups.append(GroupMetadata(
                block_size=bs,
                block_table=torch.tensor(padded, dtype=torch.int32, device=self.device),
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device)))
        ctx = ForwardContext(positions=torch.tensor(positions, dtype=torch.long, device=self.device),
                             query_start_loc=starts, seq_lens=seq_lens, groups=groups,
                             decode_only=all(len(seq.token_ids) == 1 for seq in seqs))
        return torch.tensor(ids, dtype=torch.long, device=self.device), ctx
