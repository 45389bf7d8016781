"""The engine step loop: add_request · step() · abort.

One step reads: plan = scheduler.schedule(); result = runner.execute(plan);
finished = scheduler.update(plan, result); then detokenise and report. The
engine owns the tokenizer and one incremental detokenizer per sequence; stop
strings end a sequence here because only the engine sees text.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.models.loader import load_model
from deepinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.kv_cache import KVCacheManager, build_groups
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.structured.base import CompiledGrammar, StructuredOutputBackend

logger = logging.getLogger(__name__)


@dataclass
class _UserRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]           # one per sequence; empty without a tokenizer
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = field(default=None)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        # Without a tokenizer (skip_tokenizer_init) prompts are token ids and outputs carry no text.
        self.tokenizer = None if config.model.skip_tokenizer_init else Tokenizer(config.model.path)
        eos_ids = (config.model.config_eos_token_ids if self.tokenizer is None
                   else self.tokenizer.eos_token_ids)
        self.model = load_model(config.model, config.device, config.seed)
        self.runner = ModelRunner(config, self.model, eos_ids)
        specs = [layer.kv_spec for layer in self.model.kv_cache_layers()]
        groups = build_groups(specs, config.cache.block_size)
        num_blocks = self.runner.determine_num_blocks(groups)
        self.runner.allocate_kv_cache(groups, num_blocks)
        self.kv = KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.model.max_model_len, eos_ids)
        self.requests: dict[str, _UserRequest] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self._token_text: dict[int, str] = {}
        self.structured: StructuredOutputBackend | None = None   # made by the first structured request
        logger.info("KV cache: %d blocks, groups %s", num_blocks,
                    [(g.kind, len(g.layer_ids), g.block_size) for g in groups])

    # -- intake -------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request. Raises ValueError for invalid input; a prompt that can
        never fit is accepted and finishes at once with finish_reason "error"."""
        params = params or SamplingParams()
        params.verify_for_model(self.config.model.vocab_size)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop
                                       or params.structured_outputs is not None):
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): prompts must be token "
                             "ids, and stop strings and structured outputs are unavailable")
        grammar = self._compile_grammar(params)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.model.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is out of range [0, "
                                 f"{self.config.model.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        arrival = next(self._arrival)
        seqs = [Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                        parent_id=request_id, index=i, prompt_token_ids=list(ids), params=params,
                        arrival=arrival) for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                         params.stop, params.include_stop_str_in_output,
                                         min_tokens=params.min_tokens)
                  for _ in seqs] if self.tokenizer is not None else []
        user = _UserRequest(prompt=text, prompt_token_ids=list(ids), seqs=seqs, detoks=detoks)
        self.requests[request_id] = user
        reason = self.scheduler.check_fits(len(ids))
        if reason is not None:
            user.error = reason
            for s in seqs:
                s.status = RequestStatus.FINISHED_ERROR
                s.error = reason
            return request_id
        self.scheduler.add(seqs, grammar)
        return request_id

    def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of a structured request (cached); ValueError for a bad spec."""
        if params.structured_outputs is None:
            return None
        if self.structured is None:
            # Imported here: xgrammar takes seconds to import, engines without structured
            # requests never pay it.
            from deepinfer.structured.xgrammar_backend import XGrammarBackend
            self.structured = XGrammarBackend.from_tokenizer_file(
                Path(self.config.model.path) / "tokenizer.json", self.config.model.vocab_size,
                self.tokenizer.eos_token_ids, self.tokenizer.all_special_ids)
        return self.structured.compile(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or any(
            all(s.is_finished for s in u.seqs) for u in self.requests.values())

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        touched: list[Request] = []
        if not plan.is_empty or plan.block_copies or plan.finished_req_ids:
            try:
                result = self.runner.execute(plan)
            except Exception as exc:  # an internal fault ends the batch's requests, not the engine
                logger.exception("step failed")
                for seq in plan.seqs:
                    req = self.scheduler.requests.get(seq.req_id)
                    if req is not None:
                        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR,
                                              error=f"internal error: {exc}")
            else:
                touched = self.scheduler.update(plan, result)
        for req in touched:
            self._detokenize(req)
        parents = {r.parent_id for r in touched}
        parents.update(r.parent_id for r in self.scheduler.drain_ended())
        parents.update(pid for pid, u in self.requests.items() if u.error is not None)
        return [self._output(pid) for pid in sorted(parents, key=self._order) if pid in self.requests]

    def _order(self, parent_id: str) -> int:
        return self.requests[parent_id].seqs[0].arrival

    def _detokenize(self, req: Request) -> None:
        user = self.requests[req.parent_id]
        if not user.detoks:
            return
        detok = user.detoks[req.index]
        stop = detok.add_tokens(req.output_token_ids[len(detok.token_ids):])
        if stop is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)

    def _output(self, parent_id: str) -> RequestOutput:
        user = self.requests[parent_id]
        outputs = []
        for i, req in enumerate(user.seqs):
            detok = user.detoks[i] if user.detoks else None
            want_logprobs = req.params.logprobs is not None
            outputs.append(CompletionOutput(
                index=req.index, text=detok.text if detok else "", token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if want_logprobs else None,
                logprobs=self._with_text(list(req.logprobs)) if want_logprobs else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                delta_text=detok.stream_delta(finished=req.is_finished) if detok else ""))
        finished = all(r.is_finished for r in user.seqs)
        first = user.seqs[0]
        prompt_lp = None
        if first.params.prompt_logprobs is not None:
            prompt_lp = [None if p is None else self._with_text([p])[0] for p in first.prompt_logprobs]
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
