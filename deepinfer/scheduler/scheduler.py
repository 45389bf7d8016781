"""Continuous-batching scheduler: pure CPU bookkeeping over Request objects.

Each step it spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` sequences: running sequences first (decodes and unfinished
chunked prefills, oldest first), then waiting ones in arrival order (FCFS),
each admitted with whatever prefix the cache already holds. When blocks run
out, the most recently admitted running sequence is preempted: its blocks go
back to the pool and it is recomputed later, which leaves its output unchanged
(sampling is keyed by output position). It never touches device tensors; its
output is a StepPlan.

Launched steps. ``schedule()`` hands out a plan as launched: the tokens it feeds
count as computed at once, and ``update(plan, result)`` later lands it. In the
synchronous loop every plan lands before the next is made. With overlapped
scheduling (``SchedulerConfig.async_scheduling``) the engine makes plan N+1 while
step N still runs on the device, so at most one plan is launched and not landed
when ``schedule()`` runs:

- A sequence that samples in step N holds one *pending* token: step N+1 feeds it
  as a placeholder (the runner gathers it from step N's sampled ids on the
  device). A pending sequence whose token surely ends it (``max_tokens``,
  ``max_model_len``) is not scheduled again; one that EOS, a stop token or a stop
  string ends is, and its step N+1 token is dropped when that step lands (a
  finished sequence takes no more tokens).
- Deferred frees. No block goes back to the pool while a launched step that has
  not landed may read or write it: a sequence that finishes (stop, length, abort,
  error) while in a launched step keeps its blocks, and the runner its state,
  until every such step has landed; a sequence in a launched step is never
  chosen for preemption (when the pool runs dry the plan stops there and the
  engine lands the step before planning again); and a sliding-window group frees
  only blocks the in-flight step's query can no longer see.
- Fallback: the next plan must wait for step N's tokens to reach the host
  (``StepPlan.sync_reason``) when a sequence sampled in step N has a grammar
  (its matcher accepts the token before the next bitmask is filled), uses
  repetition/frequency/presence penalties or a bad word of several tokens (they read
  output token values), forks ``n > 1`` siblings (they take the parent's blocks as of
  step N), or when step N computes prompt logprobs (made into dicts on the host).
  min_tokens, seeds, logit_bias, allowed_token_ids and one-token bad words read only
  the output length or static data and need no fallback.

Speculative decoding (``num_speculative_tokens`` > 0): a decoding sequence with draft
tokens (``Request.spec_token_ids``, proposed by the runner in the previous step's result)
feeds its last sampled token plus as many drafts as the budget, ``max_tokens`` and
``max_model_len`` leave room for (``ScheduledSeq.num_draft``). When the step lands, the
accepted drafts and the target's own next token are appended (stopping at the first that
ends the sequence) and ``num_computed_tokens`` falls back to the tokens actually committed:
the rejected drafts' KV entries stay in held blocks and are overwritten by position, so
nothing else rolls back. With a model drafter (``drafts_on_device``) the next step of a
sequence whose speculative step is in flight is planned ahead of it (``_scheduled_ahead``,
``ScheduledSeq.ahead``): from where it starts when every draft in flight is accepted, with
blocks for that case; landing the in-flight step sets its true start (``_resolve_ahead``).
A sequence the in-flight step may end by length waits for it instead. Drafts from the host
(n-gram) and varlen verification keep speculative steps synchronous. With varlen
verification (``varlen_sps``), each decoding sequence verifies the prefix of its drafts that
DSpark's hardware-aware scheduler picks from the drafts' confidences (``_varlen_lengths``);
otherwise all of them.
A model drafter that writes cache slots past the fed tokens while proposing (the chained MTP
drafter: ``num_lookahead_tokens``) gets blocks for them too when the pool has room; they are
never worth a preemption.

Bounded replay ("YOCO prefill truncation", ``replay_keep_tokens`` from
``CausalLM.replay_keep_tokens``): the model's late layers compute only a prompt's
last ``keep`` tokens. Each request gets a fixed ``replay_start`` (the first
position they compute) when it is queued, sent to the runner with its new-request
data, and its prefix-cache hits stop there (see ``_max_prefix_hit``).

KV-cache tiers (``kv.tiers``): a waiting sequence whose prefix reaches further in the host
or disk tier than in the device cache first has those blocks loaded back
(``KVCacheManager.plan_tier_load``: the loads go out with the plan) and waits, at the head
of the queue, until the step carrying them lands; other sequences' steps run meanwhile.
Then its lookup finds the loaded blocks on the device, and the hit counts in
``num_cached_tokens`` as any other. A load whose sequence ended meanwhile gives its blocks
back when it lands.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np

from deepinfer.config import SchedulerConfig
from deepinfer.request import Request, RequestStatus
from deepinfer.scheduler.kv_cache import KVCacheManager
from deepinfer.scheduler.kv_tiers import TierLoad
from deepinfer.scheduler.plan import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    SampledToken,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from deepinfer.spec.scheduling import SPSTable
from deepinfer.spec.scheduling import schedule as schedule_drafts
from deepinfer.spec.stats import SpecDecodingStats
from deepinfer.structured.base import CompiledGrammar


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: Iterable[int], replay_keep_tokens: int | None = None,
                 num_speculative_tokens: int = 0, varlen_sps: SPSTable | None = None,
                 num_lookahead_tokens: int = 0, prefix_hit_margin: int = 0,
                 drafts_on_device: bool = False) -> None:
        self.config = config
        # Speculative decoding: the most draft tokens a sequence verifies per step (0: off),
        # and with varlen verification the target's steps per second by token batch size.
        self.num_speculative_tokens = num_speculative_tokens
        self.varlen_sps = varlen_sps
        self._draft_budget: dict[str, int] = {}     # varlen: req_id -> drafts this plan verifies
        # The drafter proposes on the device inside the step (a model drafter): a speculative
        # step may be planned before the one in flight lands (see the module docstring).
        self.drafts_on_device = drafts_on_device
        # Slots past a step's last fed token a model drafter writes while proposing (a chained
        # drafter's later steps): held when the pool has room, never at the cost of a preemption.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Positions before a prefix hit's end that the model drafter's rows make stale (they
        # depend on the token after them): a hit stops before them.
        self.prefix_hit_margin = prefix_hit_margin
        self.spec_stats = SpecDecodingStats()
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Bounded replay: the trailing prompt tokens the model's late layers compute; None: off.
        self.replay_keep_tokens = replay_keep_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._runner_known: set[str] = set()
        self._finished_for_runner: list[str] = []
        self._pending_copies: list[tuple[int, int]] = []
        # Sequences ended since the engine last asked (see drain_ended).
        self._ended: list[Request] = []
        # Compiled grammars of structured sequences, sent to the runner with their new-request data.
        self._grammars: dict[str, CompiledGrammar] = {}
        # req_id -> first position fed by each launched plan that includes it (fork siblings
        # too) and has not landed, oldest first.
        self._in_flight: dict[str, list[int]] = {}
        # req_id -> tokens sampled for it in launched plans that have not landed.
        self._pending: dict[str, int] = {}
        # req_id -> its sampled seqs in launched plans that have not landed, oldest first: the
        # most tokens those plans commit (speculative decoding) is the sum of 1 + num_draft.
        self._sampled_in_flight: dict[str, list[ScheduledSeq]] = {}
        # Ended sequences whose blocks and runner state wait for their launched plans to land.
        self._deferred: set[str] = set()
        # req_id -> its prefix hit being loaded from a lower tier (kept until it is adopted).
        self._tier_loads: dict[str, TierLoad] = {}
        # req_id -> its last landed load, whose tier its hit counts for once it is admitted.
        self._tier_credit: dict[str, TierLoad] = {}

    # -- intake --------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run, or None if it can."""
        if num_prompt_tokens >= self.max_model_len:
            return (f"prompt has {num_prompt_tokens} tokens; max_model_len={self.max_model_len} "
                    "leaves no room to generate")
        need = self.kv.max_blocks_for(num_prompt_tokens + 1)
        if need > self.kv.pool.num_blocks - 1:
            return (f"prompt has {num_prompt_tokens} tokens and needs {need} KV-cache blocks; "
                    f"the whole cache has {self.kv.pool.num_blocks - 1}")
        return None

    def add(self, seqs: list[Request], grammar: CompiledGrammar | None = None) -> None:
        """Queue a user request's sequences; siblings of ``seqs[0]`` wait to be forked.
        ``grammar`` (structured outputs) constrains every one of them."""
        first, rest = seqs[0], seqs[1:]
        # One value for all siblings (same prompt and parameters), fixed from here on:
        # preemption and recompute replay the same positions, so outputs do not change.
        replay_start = self._replay_start(first)
        for r in seqs:
            self.requests[r.request_id] = r
            r.replay_start = replay_start
            if grammar is not None:
                self._grammars[r.request_id] = grammar
        for r in rest:
            r.status = RequestStatus.FORK_PENDING
        first.fork_children = list(rest)
        self.waiting.append(first)

    def _replay_start(self, req: Request) -> int:
        """The first prompt position the model's late layers compute for ``req``. Prompt
        logprobs need logits, hence every layer, at every prompt position: 0 then."""
        if self.replay_keep_tokens is None or req.params.prompt_logprobs is not None:
            return 0
        return max(0, req.num_prompt_tokens - self.replay_keep_tokens)

    def _max_prefix_hit(self, req: Request) -> int | None:
        """The most tokens a prefix-cache hit may cover for ``req`` (None: no bound beyond
        the cache's own rules).

        With bounded replay on, a cached block holds the late layers' window rows only at
        positions its writer computed them for, i.e. from the writer's replay_start on, and
        that depends on the writer's prompt (a longer prompt sharing our prefix starts
        later). The early layers' entries are in every cached block, and below our
        replay_start we need nothing else; at and after it we need the late-layer rows too,
        so we compute those positions ourselves. Hence the cap is our replay_start for every
        request, and 0 (no hit) for a prompt not longer than ``keep``, which runs every layer
        on every token. Blocks are still registered as usual: the early-layer part is what
        others reuse."""
        return None if self.replay_keep_tokens is None else req.replay_start

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_ended(self) -> bool:
        """Some sequence ended since the last :meth:`drain_ended`."""
        return bool(self._ended)

    @property
    def has_in_flight(self) -> bool:
        """Some launched plan has not landed yet."""
        return bool(self._in_flight)

    # -- planning ------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan, counted as launched until ``update`` lands it."""
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        new_requests: list[NewRequestData] = []
        preempted = stalled = False
        if self.varlen_sps is not None:
            self._draft_budget = self._varlen_lengths()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = self._pending.get(req.request_id, 0)
            if pending and self._ends_on_pending(req, pending):
                i += 1
                continue
            ahead = bool(pending and self.num_speculative_tokens)
            if ahead:
                # Its speculative step is in flight: plan the next one now, for the most tokens.
                num_draft = self._num_draft_ahead(req, budget)
                if num_draft < 0:
                    # Its length limit may fall within the tokens in flight: it waits for them.
                    i += 1
                    continue
                want = 1 + num_draft
            else:
                want = min(req.num_tokens + pending - req.num_computed_tokens, budget)
                num_draft = self._num_draft(req, budget) if want == 1 and not pending else 0
                want += num_draft
            while not (n := self._allocate(req, want)):
                victim = self.running[-1]
                alone = victim is req and len(self.running) == 1
                if victim.request_id in self._in_flight or (alone and self._in_flight):
                    # The victim's blocks may still be in use by a launched step, or blocks of
                    # sequences ending in one come back when it lands: plan no further until then.
                    stalled = True
                    break
                self.running.pop()
                preempted = True
                if alone:
                    self._finish(req, RequestStatus.FINISHED_ERROR,
                                 error=f"sequence of {req.num_tokens} tokens does not fit in the KV cache")
                    break
                self._preempt(victim)
                if victim is req:
                    break
            else:
                if ahead:
                    seqs.append(self._scheduled_ahead(req, n))
                else:
                    seqs.append(self._scheduled(req, n, new_requests, num_draft=max(0, min(num_draft, n - 1))))
                budget -= n
                i += 1
                continue
            break

        while (not preempted and not stalled and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            tokens = req.all_token_ids
            hit = 0
            load = self._tier_loads.get(req.request_id)
            if load is not None and not load.landed:
                break      # its blocks are still coming from a lower tier
            if not req.wants_prompt_logprobs:
                cap = self._max_prefix_hit(req)
                hit = self.kv.find_prefix_hit(req.request_id, tokens, cap)
                if hit and self.prefix_hit_margin:
                    # The drafter's rows just before the hit's end depend on the token after
                    # them (the writer's): recompute them (a shorter hit, at its granularity).
                    hit = self.kv.find_prefix_hit(req.request_id, tokens, hit - self.prefix_hit_margin)
                if load is None and self.kv.tiers is not None:
                    load = self.kv.plan_tier_load(req.request_id, tokens, cap, hit)
                    if load is not None:
                        self._tier_loads[req.request_id] = load
                        break
            remaining = req.num_tokens - hit
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            copies = self.kv.take_prefix_hit(req.request_id, tokens, hit) if hit else []
            req.num_computed_tokens = hit
            # Shrinking a new request's chunk to squeeze it in would only thrash the
            # running ones; it is done only when nothing runs.
            n = self._allocate(req, n) if not self.running else (
                n if self._hold(req.request_id, hit, hit + n) else 0)
            if load is not None:
                # The hit holds what it adopted; the rest of the loaded blocks stay cached.
                del self._tier_loads[req.request_id]
                self.kv.release_tier_load(load)
                self._tier_credit[req.request_id] = load
            if n and req.request_id in self._tier_credit:
                self.kv.count_tier_hit(self._tier_credit.pop(req.request_id), hit)
            if not n:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                if any(load.landed for load in self._tier_loads.values()):
                    # Blocks loaded for sequences further back are held: give them back (they
                    # stay cached) and try again, rather than refuse this one.
                    self._release_landed_tier_loads()
                    break
                if not self.running and not self._in_flight:
                    self.waiting.popleft()
                    self._finish(req, RequestStatus.FINISHED_ERROR,
                                 error=f"sequence of {req.num_tokens} tokens does not fit in the KV cache")
                    continue
                break
            self.waiting.popleft()
            self._pending_copies.extend(copies)
            if not req.wants_prompt_logprobs:
                self.kv.count_lookup(len(tokens), hit)
            if req.status == RequestStatus.WAITING and req.num_output_tokens == 0:
                req.num_cached_tokens = hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(self._scheduled(req, n, new_requests))
            budget -= n

        plan = StepPlan(seqs=seqs, new_requests=new_requests,
                        finished_req_ids=self._finished_for_runner,
                        block_copies=self._pending_copies, kv_tier_ops=self.kv.take_tier_ops(),
                        sync_reason=self._sync_reason(seqs))
        self._finished_for_runner = []
        self._pending_copies = []
        return plan

    def _num_draft(self, req: Request, budget: int) -> int:
        """How many of ``req``'s draft tokens a decode step verifies: all of them, up to the
        budget left after its own token and the room ``max_tokens`` and ``max_model_len``
        leave after the token the target adds."""
        if not req.spec_token_ids:
            return 0
        if self.varlen_sps is not None:
            budget = min(budget, 1 + self._draft_budget.get(req.request_id, 0))
        room = min(budget, self.max_model_len - req.num_tokens) - 1
        p = req.params
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return max(0, min(len(req.spec_token_ids), room))

    def _max_in_flight(self, req_id: str) -> int:
        """The most tokens ``req_id``'s launched plans that have not landed commit."""
        return sum(1 + s.num_draft for s in self._sampled_in_flight.get(req_id, ()))

    def _num_draft_ahead(self, req: Request, budget: int) -> int:
        """How many drafts the step planned ahead of ``req``'s in-flight one verifies: every
        draft a model drafter proposes, up to the budget left after its own token and the room
        ``max_tokens`` and ``max_model_len`` leave when every token in flight is committed;
        -1 when they may leave none (the sequence may end on a token in flight)."""
        most = self._max_in_flight(req.request_id)
        room = min(budget, self.max_model_len - req.num_tokens - most) - 1
        p = req.params
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - most - 1)
        return max(-1, min(self.num_speculative_tokens, room))

    def _varlen_lengths(self) -> dict[str, int]:
        """Varlen verification: how many of its drafts each decoding sequence verifies, by the
        hardware-aware prefix scheduler (spec/scheduling.py, with its early stop) over the
        drafts' confidences and the SPS table. The batch it sizes is the decoding sequences'
        tokens; prefill chunks sharing the step are not counted."""
        decoding = [r for r in self.running
                    if r.spec_confidences and r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return {}
        conf = np.zeros((len(decoding), self.num_speculative_tokens))            # [R, γ]
        for i, r in enumerate(decoding):
            c = r.spec_confidences[:self.num_speculative_tokens]
            conf[i, :len(c)] = c
        lengths = schedule_drafts(conf, self.varlen_sps)
        return {r.request_id: int(n) for r, n in zip(decoding, lengths)}

    def _take_drafts(self, req: Request, result: StepResult) -> None:
        req.spec_token_ids = result.draft_token_ids.get(req.request_id, [])
        req.spec_confidences = result.draft_confidences.get(req.request_id, [])

    def _ends_on_pending(self, req: Request, pending: int) -> bool:
        """The token(s) still in flight surely end ``req`` by length: nothing more to plan."""
        p = req.params
        return ((p.max_tokens is not None and req.num_output_tokens + pending >= p.max_tokens)
                or req.num_tokens + pending >= self.max_model_len)

    def _allocate(self, req: Request, n: int) -> int:
        """Hold blocks for ``n`` more tokens after ``req.num_computed_tokens``; with chunked
        prefill, shrink the chunk (sliding-window layers need blocks for every token of a
        chunk) until it fits. Returns the tokens granted, 0 if not even one fits.
        A sliding window is advanced only as far as the earliest query of a launched step
        that has not landed: the blocks that query reads stay held."""
        start = req.num_computed_tokens
        window_from = min([start, *self._in_flight.get(req.request_id, [])])
        while not self._hold(req.request_id, window_from, start + n):
            if n == 1 or not self.config.enable_chunked_prefill:
                return 0
            n //= 2
        return n

    def _hold(self, req_id: str, num_computed: int, num_tokens: int) -> bool:
        """``kv.allocate`` for ``num_tokens`` tokens, plus the drafter's lookahead slots when
        the pool has room for them too (best effort: only the tokens decide success)."""
        look = self.num_lookahead_tokens
        if look and self.kv.allocate(req_id, num_computed, num_tokens + look):
            return True
        return self.kv.allocate(req_id, num_computed, num_tokens)

    def _scheduled(self, req: Request, n: int, new_requests: list[NewRequestData],
                   num_draft: int = 0) -> ScheduledSeq:
        """Plan ``n`` tokens of ``req`` (the last ``num_draft`` of them its draft tokens) and
        count them as launched."""
        start = req.num_computed_tokens
        pending = self._pending.get(req.request_id, 0)
        assert pending <= 1, f"{req.request_id} has {pending} tokens in flight while being planned"
        sample = start + n - num_draft == req.num_tokens + pending
        token_ids = req.token_ids_between(start, start + n - num_draft) + req.spec_token_ids[:num_draft]
        if pending:
            # The only token left to compute is the one the launched step samples.
            token_ids.append(PLACEHOLDER_TOKEN_ID)
        rows = 0
        if req.wants_prompt_logprobs:
            rows = max(0, min(start + n, req.num_prompt_tokens - 1) - start)
        fork_ids = []
        if sample and req.fork_children and req.num_output_tokens == 0:
            fork_ids = [c.request_id for c in req.fork_children]
        for r in [req, *(self.requests[c] for c in fork_ids)]:
            if r.request_id not in self._runner_known:
                self._runner_known.add(r.request_id)
                new_requests.append(NewRequestData(
                    req_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                    output_token_ids=list(r.output_token_ids), params=r.params,
                    stream_index=r.index, grammar=self._grammars.get(r.request_id),
                    replay_start=r.replay_start))
            self._in_flight.setdefault(r.request_id, []).append(start)
        req.num_computed_tokens = start + n
        seq = ScheduledSeq(req_id=req.request_id, token_ids=token_ids,
                           start_pos=start, block_tables=self.kv.block_tables(req.request_id),
                           sample=sample, prompt_logprob_rows=rows, fork_ids=fork_ids,
                           placeholder=bool(pending), num_draft=num_draft)
        if sample:
            self._pending[req.request_id] = pending + 1
            self._sampled_in_flight.setdefault(req.request_id, []).append(seq)
        return seq

    def _scheduled_ahead(self, req: Request, n: int) -> ScheduledSeq:
        """Plan ``req``'s next speculative step while its previous one is in flight: its last
        committed token and ``n - 1`` drafts, from where the step starts when every token in
        flight is committed (``ScheduledSeq.ahead``). Its blocks cover that case; when fewer are
        accepted the step starts earlier, and landing the previous step puts the sequence's
        view (start, tokens, ``num_computed_tokens``) right (:meth:`_resolve_ahead`)."""
        start = req.num_computed_tokens
        prev = self._sampled_in_flight[req.request_id][-1]
        # The earliest the step can start (every draft in flight rejected): the sliding-window
        # blocks that position reads stay held until the step lands.
        self._in_flight[req.request_id].append(start - prev.num_draft)
        req.num_computed_tokens = start + n
        self._pending[req.request_id] += 1
        seq = ScheduledSeq(req_id=req.request_id, token_ids=[PLACEHOLDER_TOKEN_ID] * n, start_pos=start,
                           block_tables=self.kv.block_tables(req.request_id), sample=True,
                           placeholder=True, num_draft=n - 1, ahead=True)
        self._sampled_in_flight[req.request_id].append(seq)
        return seq

    def _resolve_ahead(self, req: Request, result: StepResult) -> None:
        """The step before ``req``'s planned-ahead step landed and ``req`` goes on: that step
        starts at its last committed token and verifies the drafts the landed step proposed
        (as many as it planned for, or fewer), as the runner resolved it at launch."""
        later = self._sampled_in_flight.get(req.request_id, [])
        if not later:
            req.num_computed_tokens = req.num_tokens - 1     # the cache holds all but the last
            return
        seq = later[0]
        if not seq.ahead:
            return
        drafts = result.draft_token_ids.get(req.request_id, [])[:seq.num_draft]
        seq.start_pos = req.num_tokens - 1
        seq.token_ids = [req.output_token_ids[-1], *drafts]
        seq.num_draft = len(drafts)
        seq.placeholder = seq.ahead = False
        req.num_computed_tokens = seq.start_pos + len(seq.token_ids)

    def _sync_reason(self, seqs: list[ScheduledSeq]) -> str | None:
        """Why the plan after these ``seqs`` needs their sampled tokens on the host first
        (the fallback list of the module docstring), or None."""
        for seq in seqs:
            if seq.prompt_logprob_rows:
                return "prompt logprobs"
            if not seq.sample:
                continue
            if seq.fork_ids:
                return "n > 1 fork"
            if seq.req_id in self._grammars:
                return "structured outputs"
            p = self.requests[seq.req_id].params
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                return "penalties"
            if any(len(word) > 1 for word in p.bad_words_token_ids or ()):
                return "bad words"
            if self.num_speculative_tokens:
                reason = self._speculative_sync_reason()
                if reason is not None:
                    return reason
        return None

    def _speculative_sync_reason(self) -> str | None:
        """Why a speculative step cannot be planned before the one in flight lands, or None:
        its drafts or how many of them it verifies come from the host (an n-gram drafter,
        varlen verification by the drafts' confidences)."""
        if not self.drafts_on_device:
            return "speculative decoding: drafts proposed on the host"
        if self.varlen_sps is not None:
            return "speculative decoding: varlen verification schedules by the drafts' confidences"
        return None

    # -- results ---------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Land a launched plan: apply its results. Returns the sequences that got a
        token or finished."""
        self._land(plan)
        self._land_tier_loads(plan, result.kv_load_failures)
        touched: list[Request] = []
        for seq in plan.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.is_finished:
                continue   # ended after this plan was made: its tokens are dropped
            if seq.num_draft:
                self._land_verified(req, seq, result)
                touched.append(req)
                continue
            done = seq.start_pos + len(seq.token_ids)   # tokens in the cache now this step landed
            if self.kv.completes_block(req.request_id, done):
                self.kv.cache_blocks(req.request_id, req.all_token_ids, done)
            if seq.req_id in result.prompt_logprobs and not req.prompt_logprobs_done:
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)
                req.prompt_logprobs.extend(result.prompt_logprobs[seq.req_id])
            if not seq.sample:
                continue
            for child_id in seq.fork_ids:
                child = self.requests[child_id]
                req.fork_children.remove(child)
                if child.is_finished:
                    continue
                self._fork(req, child, done)
                self._append(child, result.sampled[child_id])
                self._take_drafts(child, result)
                touched.append(child)
            self._append(req, result.sampled[req.request_id])
            self._take_drafts(req, result)
            if self.num_speculative_tokens and not req.is_finished:
                self._resolve_ahead(req, result)
            touched.append(req)
        return touched

    def _land_verified(self, req: Request, seq: ScheduledSeq, result: StepResult) -> None:
        """Apply a verification step: the accepted drafts, then the target's token, each until
        one ends the sequence; the cache holds the last sampled token and the accepted drafts."""
        accepted = result.accepted.get(req.request_id, [])
        self.spec_stats.observe(seq.num_draft, len(accepted))
        for tok in [*accepted, result.sampled[req.request_id]]:
            self._append(req, tok)
            if req.is_finished:
                return
        done = seq.start_pos + len(seq.token_ids) - seq.num_draft + len(accepted)
        self.kv.cache_blocks(req.request_id, req.all_token_ids, done)
        self._take_drafts(req, result)
        self._resolve_ahead(req, result)

    def _land_tier_loads(self, plan: StepPlan, failed: set[bytes], corrupt: bool = True) -> None:
        """The plan's tier loads are done: register what arrived intact (``failed``: keys
        whose load failed; ``corrupt``: because their disk entries are). A load whose
        sequence ended meanwhile gives its blocks back now."""
        for req_id in dict.fromkeys(op.req_id for op in plan.kv_tier_ops if op.kind == "load"):
            load = self._tier_loads[req_id]
            self.kv.land_tier_load(load, failed, corrupt)
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                del self._tier_loads[req_id]
                self.kv.release_tier_load(load)

    def _release_landed_tier_loads(self) -> None:
        for req_id, load in list(self._tier_loads.items()):
            if load.landed:
                del self._tier_loads[req_id]
                self.kv.release_tier_load(load)
                self._tier_credit[req_id] = load

    def fail(self, plan: StepPlan, error: str) -> None:
        """Land a launched plan whose step failed: its sequences end with ``error``."""
        # Its tier loads may be partly written: none is used.
        self._land_tier_loads(plan, {op.key for op in plan.kv_tier_ops if op.kind == "load"}, corrupt=False)
        for seq in plan.seqs:
            for req_id in [seq.req_id, *seq.fork_ids]:
                req = self.requests.get(req_id)
                if req is not None and not req.is_finished:
                    self._finish(req, RequestStatus.FINISHED_ERROR, error=error)
        self._land(plan)

    def _land(self, plan: StepPlan) -> None:
        """Count ``plan`` as landed; sequences that ended meanwhile and are in no other
        launched plan give their blocks back now."""
        for seq in plan.seqs:
            if seq.sample:
                self._pending[seq.req_id] -= 1
                if not self._pending[seq.req_id]:
                    del self._pending[seq.req_id]
                self._sampled_in_flight[seq.req_id].pop(0)
                if not self._sampled_in_flight[seq.req_id]:
                    del self._sampled_in_flight[seq.req_id]
            for req_id in [seq.req_id, *seq.fork_ids]:
                self._in_flight[req_id].pop(0)     # plans land in launch order
                if not self._in_flight[req_id]:
                    del self._in_flight[req_id]
                    if req_id in self._deferred:
                        self._deferred.discard(req_id)
                        self._release(req_id)

    def _fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        copies = None
        if len(self.running) < self.config.max_num_seqs:
            copies = self.kv.fork(parent.request_id, child.request_id, num_tokens)
        if copies is None:
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
            return
        self._pending_copies.extend(copies)
        child.num_computed_tokens = num_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _append(self, req: Request, tok: SampledToken) -> None:
        req.output_token_ids.append(tok.token_id)
        req.cumulative_logprob += tok.logprob
        if tok.top_logprobs is not None:
            req.logprobs.append(tok.top_logprobs)
        p = req.params
        if tok.error is not None:
            self._finish(req, RequestStatus.FINISHED_ERROR, error=tok.error)
        elif tok.grammar_terminated:
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif not p.ignore_eos and tok.token_id in self.eos_token_ids and req.num_output_tokens >= p.min_tokens:
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif tok.token_id in p.stop_token_ids and req.num_output_tokens >= p.min_tokens:
            self._finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=tok.token_id)
        elif p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            self._finish(req, RequestStatus.FINISHED_LENGTH)
        elif req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    # -- ending ---------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        assert req.request_id not in self._in_flight, f"{req.request_id} is preempted while in flight"
        self.kv.free(req.request_id)
        req.spec_token_ids, req.spec_confidences = [], []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """End a sequence from outside (stop string, abort, internal fault)."""
        if not req.is_finished:
            self._finish(req, status, stop_reason, error)

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None,
                error: str | None = None) -> None:
        req.status = status
        req.stop_reason = stop_reason
        req.error = error
        self._ended.append(req)
        self._grammars.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self._in_flight:
            self._deferred.add(req.request_id)
        else:
            self._release(req.request_id)
        load = self._tier_loads.get(req.request_id)
        if load is not None and load.landed:     # one still loading is released when it lands
            del self._tier_loads[req.request_id]
            self.kv.release_tier_load(load)
        self._tier_credit.pop(req.request_id, None)
        # Siblings never forked cannot outlive a sequence that ended before its prefill completed.
        for child in req.fork_children:
            if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
                self._finish(child, status, error=error)
            else:
                child.status = RequestStatus.WAITING
                self.waiting.appendleft(child)
        req.fork_children = []

    def _release(self, req_id: str) -> None:
        """Give an ended sequence's blocks back and tell the runner to drop its state."""
        self.kv.free(req_id)
        if req_id in self._runner_known:
            self._runner_known.discard(req_id)
            self._finished_for_runner.append(req_id)

    def truncate_output(self, req: Request, num_output_tokens: int) -> None:
        """Drop ``req``'s output tokens after the first ``num_output_tokens`` (a stop string the
        engine found inside a step's accepted drafts); the sequence is then finished."""
        n = num_output_tokens
        if req.logprobs:     # kept (with the cumulative logprob) only where asked for
            for tok, entry in zip(req.output_token_ids[n:], req.logprobs[n:]):
                req.cumulative_logprob -= entry[tok].logprob
            del req.logprobs[n:]
        del req.output_token_ids[n:]

    def abort(self, parent_id: str) -> list[Request]:
        ended = [r for r in self.requests.values() if r.parent_id == parent_id and not r.is_finished]
        for r in ended:
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        return ended

    def drain_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    def release(self, req: Request) -> None:
        """Forget a finished sequence once its output has been returned."""
        self.requests.pop(req.request_id, None)
