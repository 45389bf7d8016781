"""The engine step loop: add_request · step() · abort.

One step reads: plan = scheduler.schedule(); handle = runner.launch(plan);
result = runner.finish(handle); touched = scheduler.update(plan, result); then
detokenise and report. The engine owns the tokenizer and one incremental
detokenizer per sequence; stop strings end a sequence here because only the
engine sees text.

Overlapped scheduling (``SchedulerConfig.async_scheduling``, on by default) only
changes when those calls run. While the device runs step N, ``step()`` schedules
and launches step N+1 (it queues behind N), then waits for N and post-processes
it (update, detokenise, stop checks) while the device runs N+1:

    step():  schedule N+1 · launch N+1 · finish N · update N · detokenise N

The first call after idle only launches; outputs trail their step by one call.
When the in-flight step's ``sync_reason`` is set (scheduler docstring: grammar,
penalties, bad words, n > 1 fork, prompt logprobs, drafts from the host or varlen
verification) N is finished and updated before N+1 is scheduled. A speculative step with a
model drafter overlaps too: the runner makes N+1's planned-ahead sequences concrete from N's
result at launch (scheduler docstring). A step launched when nothing is left unfinished (every sequence in it
ended on its previous token) is finished at once, so an idle engine holds no
launched step and every block is back in the pool.

``stats`` counts steps, how many overlapped, and on CUDA the device's idle time
between consecutive steps (CUDA events around each step's device work).
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.batch_invariant import batch_invariant_mode
from deepinfer.config import EngineConfig
from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.models.loader import load_model
from deepinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.parallel.data import DataParallelKV, DataParallelPlan, DataParallelScheduler
from deepinfer.parallel.executor import ExecutorDeadError, MultiprocExecutor, join_external_launch
from deepinfer.parallel.groups import ParallelGroups, use_groups
from deepinfer.request import Request, RequestStatus
from deepinfer.runner.model_runner import ModelRunner, StepHandle
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.scheduler.kv_cache import KVCacheManager, build_groups, kv_bytes_per_token, page_bytes
from deepinfer.scheduler.kv_tiers import TierIndex
from deepinfer.scheduler.plan import StepPlan
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.spec.scheduling import SPSTable
from deepinfer.structured.base import CompiledGrammar, StructuredOutputBackend

logger = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Collect garbage, then move every object alive now to the garbage collector's permanent
    generation (``gc.freeze``), for a process that holds one engine for its lifetime (the
    server, a benchmark). An engine holds hundreds of thousands of long-lived objects (one per
    KV-cache block); left in the collected generations, each full collection traverses them
    all, pausing a step for tens of milliseconds (a 93 ms step in an H200 decode curve at B=128).
    Frozen objects are never collected: call :func:`gc.unfreeze` before releasing the engine."""
    gc.collect()
    gc.freeze()


@dataclass
class _UserRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]           # one per sequence; empty without a tokenizer
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = field(default=None)


@dataclass
class EngineStats:
    """Cumulative step counters; ``Engine.reset_stats`` starts them over (after warm-up)."""

    steps: int = 0               # steps launched with work
    overlapped_steps: int = 0    # of those, scheduled and launched while the previous step ran
    sync_steps: int = 0          # launched after the previous step landed because of its sync_reason
    gpu_idle_ms: float = 0.0     # CUDA: device idle time between consecutive steps, summed
    gpu_busy_ms: float = 0.0     # CUDA: device time of the measured steps, summed
    measured_steps: int = 0      # steps with both figures (not the first after idle)
    gpu_step_ms: float = 0.0     # CUDA: device time of every step, the first after idle too

    @property
    def gpu_idle_ms_per_step(self) -> float | None:
        return self.gpu_idle_ms / self.measured_steps if self.measured_steps else None

    @property
    def gpu_busy_ms_per_step(self) -> float | None:
        return self.gpu_busy_ms / self.measured_steps if self.measured_steps else None


@dataclass
class _Launched:
    plan: StepPlan | DataParallelPlan
    handle: StepHandle


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        # Without a tokenizer (skip_tokenizer_init) prompts are token ids and outputs carry no text.
        self.tokenizer = None if config.model.skip_tokenizer_init else Tokenizer(config.model.tokenizer_path)
        eos_ids = (config.model.config_eos_token_ids if self.tokenizer is None
                   else self.tokenizer.eos_token_ids)
        sched = config.scheduler
        par = config.parallel
        if par.world_size > 1 and par.distributed_executor_backend == "mp":
            # Every rank, 0 included, runs in a worker process; this process holds no model.
            self.model = None
            self.runner = MultiprocExecutor(config, eos_ids)
            replay_keep = self.runner.replay_keep
        else:
            groups = ParallelGroups()
            if par.world_size > 1:
                # This process is one rank of a torchrun launch, running its shard itself.
                config, groups = join_external_launch(config)
                self.config = config
            with use_groups(groups):
                self.model = load_model(config.model, config.device, config.seed)
                # Bounded replay: the model checks the mode (a model without it refuses the truncated
                # ones) and says how many trailing prompt tokens its late layers compute (None: all).
                replay_keep = self.model.replay_keep_tokens(sched.prefill_truncation_mode,
                                                            sched.prefill_keep_tokens)
                self.runner = ModelRunner(config, self.model, eos_ids, bounded_replay=replay_keep is not None)
        specs = self.runner.kv_cache_specs()
        groups = build_groups(specs, config.cache.block_size)
        num_blocks = self.runner.determine_num_blocks(groups)
        self.runner.allocate_kv_cache(groups, num_blocks)
        tiers = None
        if config.cache.has_lower_tiers:
            disk_entries = self.runner.enable_kv_tiers()
            tiers = TierIndex(config.cache.kv_offload_bytes, config.cache.kv_disk_bytes,
                              [g.bytes_per_block for g in groups], disk_entries)
        spec = config.speculative
        varlen_sps = self._varlen_sps() if spec and spec.varlen else None

        def scheduler(kv: KVCacheManager) -> Scheduler:
            return Scheduler(config.scheduler, kv, config.model.max_model_len, eos_ids,
                             replay_keep_tokens=replay_keep,
                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                             varlen_sps=varlen_sps, num_lookahead_tokens=self.runner.num_lookahead_tokens,
                             prefix_hit_margin=self.runner.prefix_hit_margin,
                             drafts_on_device=self.runner.drafts_on_device)

        if par.dp > 1:
            # Attention data parallelism: each DP rank's own KV cache (of num_blocks blocks on
            # its workers) and scheduler, behind one (parallel/data.py).
            caches = [KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching) for _ in range(par.dp)]
            self.kv = DataParallelKV(caches)
            self.scheduler = DataParallelScheduler([scheduler(kv) for kv in caches])
        else:
            self.kv = KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching, tiers)
            self.scheduler = scheduler(self.kv)
        self.requests: dict[str, _UserRequest] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self._token_text: dict[int, str] = {}
        self.structured: StructuredOutputBackend | None = None   # made by the first structured request
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: _Launched | None = None   # launched step not finished yet (overlap only)
        # Requests refused at add_request (prompt can never fit): reported by the next step.
        self._rejected: set[str] = set()
        # Why the model can no longer run (a parallel worker died); requests are refused then.
        self.dead: str | None = None
        self.stats = EngineStats()
        per_token, per_sequence = kv_bytes_per_token(groups)
        logger.info("KV cache: %d blocks of %d B, groups %s; %.1f B per token of context, plus up to "
                    "%.1f KiB per sequence in sliding windows", num_blocks, page_bytes(groups),
                    [(g.kind, len(g.layer_ids), g.block_size) for g in groups], per_token, per_sequence / 1024)

    def _varlen_sps(self) -> SPSTable:
        """Varlen verification's steps-per-second table: the configured one, or profiled now
        over token batch sizes 1, 2, 4, ... up to what a step of max_num_seqs sequences with
        full drafts holds (capped by max_num_batched_tokens)."""
        spec = self.config.speculative
        if not self.runner.drafter_has_confidences:
            raise ValueError(f"speculative_config varlen=True: the {spec.method} drafter has no confidences "
                             "to schedule by")
        if spec.sps_table is not None:
            return SPSTable(spec.sps_table)
        sched = self.config.scheduler
        top = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + spec.num_speculative_tokens))
        sizes = sorted({min(top, 1 << i) for i in range(top.bit_length() + 1)})
        table = self.runner.profile_steps_per_second(sizes, 1 + spec.num_speculative_tokens)
        logger.info("varlen verification: steps per second by token batch size %s", table.points)
        return table

    # -- intake -------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request. Raises ValueError for invalid input; a prompt that can
        never fit is accepted and finishes at once with finish_reason "error"."""
        if self.dead is not None:
            raise RuntimeError(f"the engine cannot run requests any more: {self.dead}")
        params = params or SamplingParams()
        model = self.config.model
        params.verify_for_model(model.vocab_size, model.max_logprobs)
        params = params.resolved_for_model(model.vocab_size)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop or params.bad_words
                                       or params.structured_outputs is not None):
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): prompts must be token "
                             "ids, and stop strings, bad words and structured outputs are unavailable")
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone()
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        grammar = self._compile_grammar(params)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            vocab = self.config.model.vocab_size
            if ids and not 0 <= min(ids) <= max(ids) < vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if params.truncate_prompt_tokens is not None:
            keep = model.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        arrival = next(self._arrival)
        seqs = [Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                        parent_id=request_id, index=i, prompt_token_ids=list(ids), params=params,
                        arrival=arrival) for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                         params.stop, params.include_stop_str_in_output,
                                         min_tokens=params.min_tokens,
                                         spaces_between_special_tokens=params.spaces_between_special_tokens)
                  for _ in seqs] if self.tokenizer is not None and params.detokenize else []
        user = _UserRequest(prompt=text, prompt_token_ids=list(ids), seqs=seqs, detoks=detoks)
        self.requests[request_id] = user
        reason = self.scheduler.check_fits(len(ids))
        if reason is not None:
            user.error = reason
            self._rejected.add(request_id)
            for s in seqs:
                s.status = RequestStatus.FINISHED_ERROR
                s.error = reason
            return request_id
        self.scheduler.add(seqs, grammar)
        return request_id

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would start the text and after a space (as vLLM:
        both forms are banned), without duplicates."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of a structured request (cached); ValueError for a bad spec."""
        if params.structured_outputs is None:
            return None
        if self.structured is None:
            # Imported here: xgrammar takes seconds to import, engines without structured
            # requests never pay it.
            from deepinfer.structured.xgrammar_backend import XGrammarBackend
            self.structured = XGrammarBackend.from_tokenizer_file(
                Path(self.config.model.tokenizer_path) / "tokenizer.json", self.config.model.vocab_size,
                self.tokenizer.eos_token_ids, self.tokenizer.all_special_ids)
        return self.structured.compile(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Work is left or an output is owed: a launched step, queued or running sequences, or
        requests that ended (finished, aborted, failed, refused) and are not reported yet."""
        return (self._in_flight is not None or self.scheduler.has_unfinished
                or self.scheduler.has_ended or bool(self._rejected))

    def reset_stats(self) -> None:
        self.stats = EngineStats()

    def persist_tiers(self) -> None:
        """Write what the KV cache's tiers hold to the disk tier, if there is one (every cached
        block of the device and host tiers, as far as its budget goes: a restarted engine finds
        them), and wait for the tiers' pending work. Call it once no step is left to run (the
        server does as it stops); the engine stays usable."""
        if isinstance(self.runner, MultiprocExecutor) or self.runner.kv_tiers is None:
            return
        if self._in_flight is not None:
            self._land(self._in_flight)
            self._in_flight = None
        self.kv.persist()
        self.runner.kv_tiers.execute(self.kv.take_tier_ops())
        self.runner.kv_tiers.close()

    def close(self) -> None:
        """:meth:`persist_tiers`, then the engine is not used after: it refuses new requests, and
        its device memory (the KV cache, CUDA graphs, the model's weights) goes back to the
        allocator, so another engine can be built in the same process. A parallel engine (which
        has no tiers) stops its worker processes instead. Idempotent."""
        if isinstance(self.runner, MultiprocExecutor):
            self.runner.close()
            self.dead = self.dead or "the engine was closed"
            return
        if self.dead == "the engine was closed":
            return
        self.persist_tiers()
        self.dead = "the engine was closed"
        self.model = None
        self.runner.release()

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.config.batch_invariant:
            return self._step()
        # The ops are replaced only while this engine computes, so other engines in the
        # process keep the stock kernels.
        with batch_invariant_mode():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        prev, self._in_flight = self._in_flight, None
        overlap = prev is not None and prev.plan.sync_reason is None
        if overlap:
            self._schedule_and_launch(overlapped=True)      # queues behind prev on the device
        touched = self._land(prev) if prev is not None else []
        if not overlap:
            self._schedule_and_launch(overlapped=False, after_sync=prev is not None)
        if self._in_flight is not None and (not self.async_scheduling or not self.scheduler.has_unfinished):
            touched += self._land(self._in_flight)
            self._in_flight = None
        if self._in_flight is None and not self.scheduler.has_unfinished:
            self.runner.reset_idle_clock()   # the gap until the next request is not the engine's
        parents = {r.parent_id for r in touched}
        parents.update(r.parent_id for r in self.scheduler.drain_ended())
        parents.update(self._rejected)
        self._rejected.clear()
        return [self._output(pid) for pid in sorted(parents, key=self._order)
                if pid in self.requests and self._reports(pid)]

    def _schedule_and_launch(self, overlapped: bool, after_sync: bool = False) -> None:
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.block_copies and not plan.finished_req_ids and not plan.kv_tier_ops:
            return
        try:
            handle = self.runner.launch(plan)
        except ExecutorDeadError as exc:
            self._fail_all(plan, str(exc))
            return
        except Exception as exc:  # an internal fault ends the batch's requests, not the engine
            logger.exception("step failed")
            self.scheduler.fail(plan, f"internal error: {exc}")
            return
        if plan.is_empty and not plan.has_tier_loads:
            return   # only runner bookkeeping and block copies: nothing to wait for
        if plan.is_empty:
            # Only tier loads: they land like a step (the sequence waiting for them is then
            # admitted), but they count as none.
            self._in_flight = _Launched(plan, handle)
            return
        self.stats.steps += 1
        self.stats.overlapped_steps += overlapped
        self.stats.sync_steps += after_sync
        self._in_flight = _Launched(plan, handle)

    def _land(self, launched: _Launched) -> list[Request]:
        """Wait for a launched step, apply its results and detokenise what it touched."""
        try:
            result = self.runner.finish(launched.handle)
        except ExecutorDeadError as exc:
            self._fail_all(launched.plan, str(exc))
            return []
        except Exception as exc:
            logger.exception("step failed")
            self.scheduler.fail(launched.plan, f"internal error: {exc}")
            return []
        if result.gpu_busy_ms is not None:
            self.stats.gpu_step_ms += result.gpu_busy_ms
        if result.gpu_idle_ms is not None and result.gpu_busy_ms is not None:
            self.stats.gpu_idle_ms += result.gpu_idle_ms
            self.stats.gpu_busy_ms += result.gpu_busy_ms
            self.stats.measured_steps += 1
        touched = self.scheduler.update(launched.plan, result)
        for req in touched:
            self._detokenize(req)
        return touched

    def _fail_all(self, plan: StepPlan | DataParallelPlan, reason: str) -> None:
        """The model cannot run any more (a parallel worker died): ``plan`` and every request
        not finished end with the error, and the engine refuses new ones."""
        self.dead = reason
        error = f"internal error: {reason}"
        self.scheduler.fail(plan, error)
        for user in self.requests.values():
            for req in user.seqs:
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, error=error)

    def _reports(self, parent_id: str) -> bool:
        """Whether this step returns the request's output: every step it advanced, or for
        ``RequestOutputKind.FINAL_ONLY`` only once it has finished or failed."""
        user = self.requests[parent_id]
        if user.seqs[0].params.output_kind is not RequestOutputKind.FINAL_ONLY:
            return True
        return user.error is not None or all(r.is_finished or r.error for r in user.seqs)

    def _order(self, parent_id: str) -> int:
        return self.requests[parent_id].seqs[0].arrival

    def _detokenize(self, req: Request) -> None:
        user = self.requests[req.parent_id]
        if not user.detoks:
            return
        detok = user.detoks[req.index]
        new = req.output_token_ids[len(detok.token_ids):]
        if len(new) > 1 and detok.stop:
            # Several tokens in one step (speculative decoding): a stop string ends the output at
            # the token that completes it, as one token per step would have.
            for i, tok in enumerate(new):
                stop = detok.add_tokens([tok])
                if stop is not None:
                    self.scheduler.truncate_output(req, len(detok.token_ids))
                    break
        else:
            stop = detok.add_tokens(new)
        if stop is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)

    def _output(self, parent_id: str) -> RequestOutput:
        user = self.requests[parent_id]
        outputs = []
        for i, req in enumerate(user.seqs):
            detok = user.detoks[i] if user.detoks else None
            want_logprobs = req.params.logprobs is not None
            logprobs = list(req.logprobs) if want_logprobs else None
            outputs.append(CompletionOutput(
                index=req.index, text=detok.text if detok else "", token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if want_logprobs else None,
                logprobs=self._with_text(logprobs) if want_logprobs and req.params.detokenize else logprobs,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                delta_text=detok.stream_delta(finished=req.is_finished) if detok else ""))
        finished = all(r.is_finished for r in user.seqs)
        first = user.seqs[0]
        prompt_lp = None
        if first.params.prompt_logprobs is not None:
            text = self._with_text if first.params.detokenize else (lambda entries: entries)
            prompt_lp = [None if p is None else text([p])[0] for p in first.prompt_logprobs]
        errors = [r.error for r in user.seqs if r.error]
        out = RequestOutput(request_id=parent_id, prompt=user.prompt,
                            prompt_token_ids=user.prompt_token_ids, prompt_logprobs=prompt_lp,
                            outputs=outputs, finished=finished,
                            num_cached_tokens=first.num_cached_tokens,
                            error=user.error or (errors[0] if errors else None))
        if finished:
            for r in user.seqs:
                self.scheduler.release(r)
            del self.requests[parent_id]
        return out

    def _with_text(self, entries: list[PositionLogprobs]) -> list[PositionLogprobs]:
        if self.tokenizer is None:
            return entries
        for entry in entries:
            for tid, lp in entry.items():
                if lp.decoded_token is None:
                    if tid not in self._token_text:
                        self._token_text[tid] = self.tokenizer.id_to_token_text(tid)
                    lp.decoded_token = self._token_text[tid]
        return entries
