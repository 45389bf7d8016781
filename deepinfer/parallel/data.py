"""Attention data parallelism on the driver: one scheduler per data-parallel (DP) rank behind
the interface of one, and the step plans and results that carry every rank's part.

What belongs here: assigning each new request to a DP rank, routing every later call about a
request (abort, finish, release, ...) to its rank's scheduler, and joining the ranks' plans
into one step. What does not: how the workers run their part (parallel/executor.py: every
rank runs every step, a rank without work a one-token dummy forward so that the MoE layers'
collectives meet) and how the MoE layers dispatch (parallel/expert.py).

Each DP rank has its own scheduler and its own KV-cache manager (its blocks are the KV cache
of its workers; the prefix cache is per rank). A request goes, with all its ``n`` sequences,
to the rank that holds the longest prefix of its prompt (cached blocks, or the prompt of a
request already assigned there that is not finished: two requests sent together with a
shared prefix then share a rank); on a tie, to the least loaded rank (tokens of its running
and waiting sequences), then the lowest. A request never moves: preemption and forks stay
inside its rank's scheduler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.request import Request, RequestStatus
from deepinfer.scheduler.kv_cache import KVCacheManager
from deepinfer.scheduler.plan import ScheduledSeq, StepPlan, StepResult, TierOp
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.spec.stats import SpecDecodingStats
from deepinfer.structured.base import CompiledGrammar


@dataclass
class DataParallelPlan:
    """One step of every DP rank: ``plans[d]`` is rank d's own plan (empty when it has no work;
    its workers then join the step's collectives with a dummy forward)."""

    plans: list[StepPlan]

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return [s for p in self.plans for s in p.seqs]

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.plans)

    @property
    def is_empty(self) -> bool:
        return all(p.is_empty for p in self.plans)

    @property
    def finished_req_ids(self) -> list[str]:
        return [r for p in self.plans for r in p.finished_req_ids]

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        # Block ids of different ranks' caches: only for "is there any"; each rank copies its own.
        return [c for p in self.plans for c in p.block_copies]

    @property
    def kv_tier_ops(self) -> list[TierOp]:
        return [op for p in self.plans for op in p.kv_tier_ops]

    @property
    def has_tier_loads(self) -> bool:
        return any(p.has_tier_loads for p in self.plans)

    @property
    def sync_reason(self) -> str | None:
        return next((p.sync_reason for p in self.plans if p.sync_reason is not None), None)


@dataclass
class DataParallelResult:
    """Every DP rank's result of one step (``results[d]``: rank d's, from its first worker)."""

    results: list[StepResult] = field(default_factory=list)

    @property
    def gpu_busy_ms(self) -> float | None:
        """The slowest rank's device time (the step ends when the last rank's does)."""
        times = [r.gpu_busy_ms for r in self.results]
        return None if any(t is None for t in times) else max(times)

    @property
    def gpu_idle_ms(self) -> float | None:
        times = [r.gpu_idle_ms for r in self.results]
        return None if any(t is None for t in times) else min(times)


class DataParallelKV:
    """The DP ranks' KV-cache managers seen as one for the counters the engine reports
    (metrics); each rank's own manager is ``managers[d]``."""

    tiers = None    # the KV cache's lower tiers are refused under parallelism

    def __init__(self, managers: Sequence[KVCacheManager]) -> None:
        self.managers = list(managers)

    @property
    def usage(self) -> float:
        return sum(m.usage for m in self.managers) / len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def prefix_queries(self) -> int:
        return sum(m.prefix_queries for m in self.managers)

    @property
    def prefix_hits(self) -> int:
        return sum(m.prefix_hits for m in self.managers)

    def __getattr__(self, name: str) -> None:
        # Whatever else reads the cache as one (KV export and import) is not rank-aware yet.
        raise NotImplementedError(f"KVCacheManager.{name} under data parallelism (data_parallel_size > 1) "
                                  "is not yet supported: each data-parallel rank has its own cache")


class DataParallelScheduler:
    """The engine's scheduler under attention data parallelism (module docstring): the
    :class:`Scheduler` calls the engine makes, each routed to the rank of the request it is
    about, or made on every rank and joined."""

    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        if len(schedulers) < 2:
            raise ValueError(f"data parallelism needs at least 2 schedulers, got {len(schedulers)}")
        self.schedulers = list(schedulers)
        self.rank_of: dict[str, int] = {}           # sequence id and parent id -> DP rank
        # Per rank: chained keys of the prompt blocks of its requests not yet released, counted,
        # so that a request sharing a prefix with one that has not been cached yet joins it.
        self._prompt_keys: list[Counter[int]] = [Counter() for _ in self.schedulers]
        self._keys_of: dict[str, list[int]] = {}    # parent id -> its prompt's chained keys

    @property
    def size(self) -> int:
        return len(self.schedulers)

    # -- assignment --------------------------------------------------------------------
    def _chain_keys(self, token_ids: Sequence[int]) -> list[int]:
        step = self.schedulers[0].kv.hit_step
        keys, prev = [], 0
        for start in range(0, len(token_ids) - step + 1, step):
            prev = hash((prev, tuple(token_ids[start:start + step])))
            keys.append(prev)
        return keys

    def load(self, rank: int) -> int:
        """Tokens of rank ``rank``'s running and waiting sequences (prompt and output)."""
        sched = self.schedulers[rank]
        return sum(r.num_tokens for r in sched.running) + sum(r.num_tokens for r in sched.waiting)

    def prefix_hit(self, rank: int, token_ids: Sequence[int], keys: list[int]) -> int:
        """Prompt tokens rank ``rank`` already holds or is about to: its prefix-cache hit, or
        the shared prefix (whole blocks) with a prompt assigned there and not yet released."""
        cached = self.schedulers[rank].kv.probe_prefix_hit(token_ids)
        pending = 0
        for key in keys:
            if not self._prompt_keys[rank][key]:
                break
            pending += 1
        return max(cached, pending * self.schedulers[rank].kv.hit_step)

    def choose_rank(self, token_ids: Sequence[int], keys: list[int]) -> int:
        """The longest prefix hit; on a tie the least load, then the lowest rank."""
        return min(range(self.size), key=lambda d: (-self.prefix_hit(d, token_ids, keys), self.load(d), d))

    # -- the Scheduler interface the engine uses ---------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> str | None:
        # Every rank's cache has the same size.
        return self.schedulers[0].check_fits(num_prompt_tokens)

    def add(self, seqs: list[Request], grammar: CompiledGrammar | None = None) -> None:
        first = seqs[0]
        keys = self._chain_keys(first.prompt_token_ids)
        rank = self.choose_rank(first.prompt_token_ids, keys)
        self.rank_of[first.parent_id] = rank
        for r in seqs:
            self.rank_of[r.request_id] = rank
        self._keys_of[first.parent_id] = keys
        self._prompt_keys[rank].update(keys)
        self.schedulers[rank].add(seqs, grammar)

    def abort(self, parent_id: str) -> list[Request]:
        rank = self.rank_of.get(parent_id)
        return [] if rank is None else self.schedulers[rank].abort(parent_id)

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers)

    @property
    def has_ended(self) -> bool:
        return any(s.has_ended for s in self.schedulers)

    @property
    def has_in_flight(self) -> bool:
        return any(s.has_in_flight for s in self.schedulers)

    def schedule(self) -> DataParallelPlan:
        return DataParallelPlan([s.schedule() for s in self.schedulers])

    def update(self, plan: DataParallelPlan, result: DataParallelResult) -> list[Request]:
        touched: list[Request] = []
        for sched, p, r in zip(self.schedulers, plan.plans, result.results):
            touched += sched.update(p, r)
        return touched

    def fail(self, plan: DataParallelPlan, error: str) -> None:
        for sched, p in zip(self.schedulers, plan.plans):
            sched.fail(p, error)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        self.schedulers[self.rank_of[req.request_id]].finish(req, status, stop_reason, error)

    def truncate_output(self, req: Request, num_output_tokens: int) -> None:
        self.schedulers[self.rank_of[req.request_id]].truncate_output(req, num_output_tokens)

    def drain_ended(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.drain_ended()]

    def release(self, req: Request) -> None:
        rank = self.rank_of.pop(req.request_id, None)
        if rank is None:
            return
        self.schedulers[rank].release(req)
        keys = self._keys_of.pop(req.parent_id, None)
        if keys is not None:     # the parent's first sequence released: its prompt leaves the rank
            self._prompt_keys[rank].subtract(keys)
            self._prompt_keys[rank] = +self._prompt_keys[rank]
            self.rank_of.pop(req.parent_id, None)

    # -- what the metrics read ------------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.schedulers for r in s.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def spec_stats(self) -> SpecDecodingStats:
        total = SpecDecodingStats()
        for s in self.schedulers:
            st = s.spec_stats
            total.num_drafts += st.num_drafts
            total.num_draft_tokens += st.num_draft_tokens
            total.num_accepted_tokens += st.num_accepted_tokens
            width = max(len(total.accepted_per_pos), len(st.accepted_per_pos))
            total.accepted_per_pos = [a + b for a, b in zip(total.accepted_per_pos + [0] * width,
                                                            st.accepted_per_pos + [0] * width)][:width]
        return total
