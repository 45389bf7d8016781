"""Running the model on several ranks: one worker process per rank, driven by the engine.

What belongs here: checking parallel sizes against the model and the machine before anything
loads, starting the workers (``multiprocessing`` spawn, ``torch.distributed`` over a free
loopback port: gloo on the CPU, NCCL on CUDA), building each rank's process groups, and the
:class:`MultiprocExecutor` that stands in for the ``ModelRunner`` in the engine. What does not:
how layers shard (``tensor.py``, the MoE layers) and scheduling (``scheduler/``).

Layout. The engine's process (the driver) keeps the tokenizer, the scheduler and the KV-cache
bookkeeping; it holds no model. Every rank, 0 included, is a worker process that loads its
shard of the model under :func:`~deepinfer.parallel.groups.use_groups` and owns a
``ModelRunner`` (its device, its part of the KV cache). Each step the driver sends the same
``StepPlan`` to every worker; all of them run it (their collectives meet inside the forward)
and rank 0's ``StepResult`` goes back to the scheduler (with EPLB on, with the load
balancer's stats: every worker steps its ``ExpertLoadBalancer`` after every step). Every rank samples from the same
gathered logits with the same seeded generator, so all keep the same tokens for the next
step's placeholders. Under attention data parallelism (``dp`` > 1, parallel/data.py) each
worker gets its data-parallel rank's own plan instead, a worker without work that step runs
a dummy forward to meet the MoE layers' collectives, and the first worker of each
data-parallel rank returns that rank's result. Keeping rank 0 out of the driver means the
driver never waits inside a collective: it only waits on pipes and on the workers' process
sentinels, so a worker that dies is noticed at once, whatever the backend.

Protocol. Each worker answers every message, in order: ``("ok", value)`` or ``("error",
traceback)``. A reading thread in the worker drains the pipe into a queue so that the driver
can send step N+1 (overlapped scheduling) while the worker still sends step N's result,
without both blocking on full pipes. The engine does not finish a launch of bookkeeping only
(no sequence to run): its replies are read and dropped before the next finished step's. A
worker exits when the driver's end of its pipe closes.

Under ``torchrun`` (``distributed_executor_backend="external_launcher"``) there is no driver:
each launched process runs a whole engine on its rank (:func:`join_external_launch`).

Faults. A worker that dies or raises leaves the others' collectives in an unknown state, so
any fault is fatal: the executor stops every worker and raises :class:`ExecutorDeadError`
(from this call and every later one); the engine fails its requests with that message.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import signal
import socket
import threading
import traceback
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.batch_invariant import batch_invariant_mode
from deepinfer.config import EngineConfig, ParallelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers.moe import FusedMoE
from deepinfer.models.loader import load_model
from deepinfer.models.registry import get_model_class
from deepinfer.parallel.balancer import EPLBConfig, EPLBStats, ExpertLoadBalancer
from deepinfer.parallel.data import DataParallelPlan, DataParallelResult
from deepinfer.parallel.context import check_context_parallel
from deepinfer.parallel.expert import ExpertParallelConfig, use_expert_parallel
from deepinfer.parallel.groups import Group, ParallelGroups, use_groups
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.scheduler.plan import StepPlan, StepResult
from deepinfer.spec.scheduling import SPSTable

logger = logging.getLogger(__name__)

# How long (s) a stopping worker may take to exit before it is terminated, then killed.
_STOP_TIMEOUT_S = 10.0

# config.json fields that count a model's routed experts, by family.
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


class ExecutorDeadError(RuntimeError):
    """A worker died or failed: the model can no longer run."""


def check_parallel(config: EngineConfig) -> None:
    """Refuse parallel sizes that the model or the machine cannot take, before anything loads:
    tp must divide the model's sharded widths (``CausalLM.check_parallel``), ep its routed
    experts (plus the redundant slots of EPLB), and on CUDA the world must fit the visible
    devices; KV-cache tiers and model drafters are not yet supported with several ranks."""
    par = config.parallel
    cls = get_model_class(config.model.architecture)
    cls.check_parallel(config.model.hf_config, par.tp)
    if par.cp > 1:
        check_context_parallel(cls, config)
    if par.ep > 1:
        counts = [config.model.hf_config[k] for k in _EXPERT_COUNT_KEYS if config.model.hf_config.get(k)]
        if not counts:
            raise ValueError(f"expert_parallel_size={par.ep}: {config.model.architecture} has no routed experts "
                             "to shard; run it with expert_parallel_size=1")
        if par.num_redundant_experts:
            slots = int(counts[0]) + par.num_redundant_experts
            if slots % par.ep:
                raise ValueError(f"expert_parallel_size={par.ep} must divide the model's {int(counts[0])} routed "
                                 f"experts + num_redundant_experts={par.num_redundant_experts} = {slots} slots")
        elif int(counts[0]) % par.ep:
            raise ValueError(f"expert_parallel_size={par.ep} must divide the model's {int(counts[0])} routed experts")
    if config.device.type == "cuda":
        available = torch.cuda.device_count()
        if par.world_size > available:
            raise ValueError(f"tensor_parallel_size={par.tp}, expert_parallel_size={par.ep}, data_parallel_size="
                             f"{par.dp}, context_parallel_size={par.cp} need {par.world_size} CUDA devices; "
                             f"{available} are visible")
    if config.cache.has_lower_tiers:
        raise NotImplementedError(f"kv_offload_gib / kv_disk_dir with {par.world_size} ranks: the KV cache's host "
                                  "and disk tiers are not yet supported under parallelism")
    spec = config.speculative
    if spec is not None and spec.method != "ngram":
        raise NotImplementedError(f"speculative_config method={spec.method!r} with {par.world_size} ranks: "
                                  "model drafters are not yet supported under parallelism; use method='ngram'")


def build_groups(parallel: ParallelConfig, rank: int) -> ParallelGroups:
    """This rank's groups: tensor-parallel blocks of ``tp`` consecutive ranks, expert-parallel
    blocks of ``ep``, context-parallel blocks of ``cp``. Every rank creates every group, in the same order (torch.distributed's rule)."""
    def blocks(size: int) -> Group:
        if size == 1:
            return Group()
        mine = None
        for start in range(0, parallel.world_size, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = Group(size=size, rank=rank - start, group=group)
        return mine

    return ParallelGroups(tp=blocks(parallel.tp), ep=blocks(parallel.ep), dp=data_parallel_group(parallel, rank),
                          cp=blocks(parallel.cp))


def data_parallel_group(parallel: ParallelConfig, rank: int) -> Group:
    """This rank's attention data-parallel group: within each block of ``tp * dp`` consecutive
    ranks, the ranks of one tensor-parallel rank (one per data-parallel rank). Every rank
    creates every group, in the same order."""
    if parallel.dp == 1:
        return Group()
    mine, width = None, parallel.tp * parallel.dp
    for start in range(0, parallel.world_size, width):
        for t in range(parallel.tp):
            members = [start + k * parallel.tp + t for k in range(parallel.dp)]
            group = dist.new_group(members)
            if rank in members:
                mine = Group(size=parallel.dp, rank=members.index(rank), group=group)
    return mine


def _first_collectives(groups: ParallelGroups, device: torch.device) -> None:
    """One collective per group: NCCL sets a communicator up on its first collective, which
    must not happen inside a CUDA-graph capture (the decode graphs)."""
    for group in (groups.tp, groups.ep, groups.dp, groups.cp):
        if not group.is_single:
            dist.all_reduce(torch.zeros(1, device=device), group=group.group)


@torch.inference_mode()
def dummy_forward(model: torch.nn.Module, device: torch.device) -> None:
    """A forward of one token without a KV cache, run only for its collectives: a data-parallel
    rank without work this step meets the others' MoE dispatch and combine (the tensor-parallel
    collectives, within its own group, come along). Its expert load is not counted. Without
    expert-parallel layers no collective crosses data-parallel ranks, and nothing runs."""
    loads = [(m.ep, m.ep.load.clone()) for m in model.modules() if isinstance(m, FusedMoE) and m.ep is not None]
    if not loads:
        return
    model(torch.zeros(1, dtype=torch.long, device=device), ForwardContext.no_cache([1], device))
    for ep, load in loads:
        ep.load.copy_(load)


def join_external_launch(config: EngineConfig) -> tuple[EngineConfig, ParallelGroups]:
    """This process as one rank of a launch someone else started (``torchrun``;
    ``distributed_executor_backend="external_launcher"``): join ``torch.distributed`` from the
    launcher's environment (``env://``) unless already joined, check the world size, and
    return the config on this rank's device (CUDA: ``cuda:rank % devices``) with its groups.
    Each rank then runs the whole engine, scheduler included: the ranks are given the same
    requests in the same order, so they plan the same steps and their collectives meet.
    Nothing watches the other ranks here: a dead peer fails the next collective (gloo) or
    waits for the backend's timeout (NCCL)."""
    check_parallel(config)
    device = config.device
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
        except ValueError as exc:
            raise ValueError(f"distributed_executor_backend='external_launcher' joins a torchrun launch, "
                             f"whose environment this process lacks: {exc}") from exc
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != config.parallel.world_size:
        raise ValueError(f"the launch has {world} ranks, but tensor_parallel_size={config.parallel.tp} and "
                         f"expert_parallel_size={config.parallel.ep} need {config.parallel.world_size}")
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    groups = build_groups(config.parallel, rank)
    _first_collectives(groups, device)
    return replace(config, device=device), groups


def free_port() -> int:
    """A TCP port free on the loopback interface now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One rank's model and ModelRunner (in its worker process)."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int], rank: int, port: int) -> None:
        world = config.parallel.world_size
        device = config.device
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        self.config = replace(config, device=device)
        self.rank = rank
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.groups = build_groups(config.parallel, rank)
        _first_collectives(self.groups, device)
        sched = config.scheduler
        par = config.parallel
        with use_groups(self.groups), use_expert_parallel(ExpertParallelConfig(par.num_redundant_experts)):
            self.model = load_model(self.config.model, device, config.seed)
            self.replay_keep = self.model.replay_keep_tokens(sched.prefill_truncation_mode, sched.prefill_keep_tokens)
            self.runner = ModelRunner(self.config, self.model, eos_token_ids,
                                      bounded_replay=self.replay_keep is not None)
        # EPLB starts with the first step, so that warm-up and profiling forwards (KV-cache
        # sizing, graph capture) count as no load.
        self.balancer: ExpertLoadBalancer | None = None

    def describe(self) -> dict[str, Any]:
        """What the engine asks of its runner before the first step."""
        r = self.runner
        return dict(replay_keep=self.replay_keep, kv_cache_specs=r.kv_cache_specs(),
                    num_lookahead_tokens=r.num_lookahead_tokens, prefix_hit_margin=r.prefix_hit_margin,
                    drafter_has_confidences=r.drafter_has_confidences, drafts_on_device=r.drafts_on_device)

    def execute(self, plan: StepPlan, after_idle: bool,
                join_collectives: bool = False) -> tuple[StepResult, EPLBStats | None] | None:
        """Run one step (``after_idle``: the engine was idle before it, so the device's idle time
        is not measured), then step EPLB when it is on. The first rank of each data-parallel
        rank returns its result (the others of its tensor-parallel group have the same) with
        the balancer's stats (rank 0's; None without EPLB). ``join_collectives``: another
        data-parallel rank has work this step while ``plan`` has none, so this rank runs a
        dummy forward to meet the MoE layers' collectives."""
        par = self.config.parallel
        if par.enable_eplb and self.balancer is None:
            self.balancer = ExpertLoadBalancer(self.model, EPLBConfig(window_size=par.eplb_window_size,
                                                                      interval=par.eplb_step_interval))
        if after_idle:
            self.runner.reset_idle_clock()
        with batch_invariant_mode() if self.config.batch_invariant else contextlib.nullcontext():
            result = self.runner.finish(self.runner.launch(plan))
            if join_collectives and plan.is_empty:
                dummy_forward(self.model, self.config.device)
        # Every rank gets every plan, so all step the balancer together (its rebalance is a set
        # of collectives), steps without MoE tokens included: those add an empty load.
        if self.balancer is not None:
            self.balancer.step()
        if not self.leads:
            return None
        return result, None if self.balancer is None or self.rank else self.balancer.stats

    @property
    def leads(self) -> bool:
        """This rank reports its data-parallel rank's results: the first of the first tensor-
        parallel group serving it."""
        par = self.config.parallel
        return self.rank < par.tp * par.dp and self.rank % par.tp == 0

    def call(self, method: str, *args: Any) -> Any:
        if method == "execute":
            return self.execute(*args)
        if method == "describe":
            return self.describe()
        return getattr(self.runner, method)(*args)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read_pipe(conn: Connection, inbox: queue.Queue) -> None:
    """Move every message from the driver into ``inbox``; None once the driver is gone."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(None)


def _worker_main(config: EngineConfig, eos_token_ids: set[int], rank: int, port: int, conn: Connection) -> None:
    """A worker process: build the rank's model, then answer the driver's calls until told to
    stop or the driver goes away."""
    # Ctrl-C reaches the whole process group: the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(config, eos_token_ids, rank, port)
    except BaseException:
        conn.send(("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        return
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_pipe, args=(conn, inbox), daemon=True).start()
    conn.send(("ok", worker.describe()))
    while True:
        msg = inbox.get()
        if msg is None or msg[0] == "stop":
            break
        method, args = msg
        try:
            reply = ("ok", worker.call(method, *args))
        except BaseException:
            reply = ("error", f"rank {rank}: {method} failed:\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    worker.close()
    conn.close()


def _stop_workers(procs: list[mp.process.BaseProcess], conns: list[Connection], graceful: bool) -> None:
    """Stop worker processes: ask them to exit (``graceful``), then terminate, then kill."""
    if graceful:
        for conn in conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
    for conn in conns:
        conn.close()
    for proc in procs:
        # After a fault the others may wait in a collective forever: no grace for them.
        if graceful:
            proc.join(timeout=_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


class MultiprocExecutor:
    """The engine's runner for ``ParallelConfig.world_size`` > 1: the ModelRunner methods the
    engine calls, each run on every worker (module docstring)."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        check_parallel(config)
        self.world_size = config.parallel.world_size
        self.parallel = config.parallel
        self.dead: str | None = None
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._launched = 0
        # Step replies read so far, and those read before (or without) their finish(): the
        # engine never finishes a plan of runner bookkeeping only (Engine._schedule_and_launch),
        # whose replies must not be taken for a later step's or call's.
        self._read = 0
        self._replies: dict[int, list[Any]] = {}
        self._idle = False    # the engine went idle since the last launch
        # EPLB's stats after the last finished step (rank 0's); None without EPLB.
        self.eplb_stats: EPLBStats | None = EPLBStats() if config.parallel.enable_eplb else None
        for rank in range(self.world_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, eos_token_ids, rank, port, theirs),
                               name=f"deepinfer-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self._stopper = weakref.finalize(self, _stop_workers, self.procs, self.conns, True)
        logger.info("started %d worker processes (%s): pids %s", self.world_size,
                    config.parallel.describe(), [p.pid for p in self.procs])
        info = self._collect()[0]
        self.replay_keep: int | None = info["replay_keep"]
        self._kv_cache_specs: list[KVCacheSpec] = info["kv_cache_specs"]
        self.num_lookahead_tokens: int = info["num_lookahead_tokens"]
        self.prefix_hit_margin: int = info["prefix_hit_margin"]
        self.drafter_has_confidences: bool = info["drafter_has_confidences"]
        self.drafts_on_device: bool = info["drafts_on_device"]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- the runner's interface -----------------------------------------------------
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return list(self._kv_cache_specs)

    def determine_num_blocks(self, groups: list[KVCacheGroup]) -> int:
        """The fewest blocks any rank's budget holds (every rank keeps the same block ids)."""
        return min(self._call_all("determine_num_blocks", groups))

    def allocate_kv_cache(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self._call_all("allocate_kv_cache", groups, num_blocks)

    def profile_steps_per_second(self, sizes: list[int], seq_len: int) -> SPSTable:
        return self._call_all("profile_steps_per_second", sizes, seq_len)[0]

    def reset_idle_clock(self) -> None:
        # Told with the next step: no round trip to the workers while the engine is idle.
        self._idle = True

    def launch(self, plan: StepPlan | DataParallelPlan) -> int:
        """Send ``plan`` to every worker (a data-parallel plan: each worker its DP rank's part);
        the handle is the step's number."""
        if isinstance(plan, DataParallelPlan):
            busy = not plan.is_empty
            par = self.parallel
            self._send_each("execute", [(plan.plans[par.dp_rank_of(r)], self._idle, busy)
                                        for r in range(self.world_size)])
        else:
            self._send_all("execute", plan, self._idle)
        self._idle = False
        self._launched += 1
        return self._launched

    def finish(self, handle: int) -> StepResult | DataParallelResult:
        """Rank 0's result of the step launched as ``handle`` (steps finish in launch order;
        the replies of earlier steps never finished are dropped), or under data parallelism
        each DP rank's; the EPLB stats that come with rank 0's are kept in :attr:`eplb_stats`."""
        while self._read < handle:
            self._read_step()
        replies = self._replies.pop(handle)
        for stale in [h for h in self._replies if h < handle]:
            del self._replies[stale]
        result, stats = replies[0]
        if stats is not None:
            self.eplb_stats = stats
        if self.parallel.dp == 1:
            return result
        return DataParallelResult([replies[d * self.parallel.tp][0] for d in range(self.parallel.dp)])

    # -- plumbing -----------------------------------------------------------------------
    def _read_step(self) -> None:
        self._read += 1
        self._replies[self._read] = self._collect()

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        # Replies come in order: the steps' sent before this call are read first.
        while self._read < self._launched:
            self._read_step()
        self._send_all(method, *args)
        return self._collect()

    def _send_all(self, method: str, *args: Any) -> None:
        self._send_each(method, [args] * self.world_size)

    def _send_each(self, method: str, args: list[tuple]) -> None:
        """``method`` to every worker, rank r with ``args[r]``."""
        self._check_alive()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args[rank]))
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) is gone "
                           f"(exit code {self.procs[rank].exitcode})")

    def _collect(self) -> list[Any]:
        """One reply from every worker; a worker that exits before replying, or replies with an
        error, kills the executor."""
        self._check_alive()
        replies: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            waits: dict[Any, tuple[int, bool]] = {}
            for r in pending:
                waits[self.conns[r]] = (r, True)
                waits[self.procs[r].sentinel] = (r, False)
            for obj in wait(list(waits)):
                rank, is_conn = waits[obj]
                if rank not in pending:
                    continue
                conn = self.conns[rank]
                if not is_conn and not conn.poll():
                    self.procs[rank].join(timeout=1.0)
                    self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) died "
                               f"(exit code {self.procs[rank].exitcode})")
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=1.0)
                    self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) died "
                               f"(exit code {self.procs[rank].exitcode})")
                if status == "error":
                    self._fail(self._first_death() or value)
                replies[rank] = value
                pending.discard(rank)
        return replies

    def _first_death(self) -> str | None:
        """Which worker died, if one did within a second: a rank's collective fails when a peer
        dies, and the death, not the failed collective, is the cause to report."""
        wait([p.sentinel for p in self.procs], timeout=1.0)
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"
        return None

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise ExecutorDeadError(self.dead)

    def _fail(self, reason: str) -> None:
        logger.error("parallel executor failed: %s", reason)
        self.dead = reason
        self._stopper.detach()
        _stop_workers(self.procs, self.conns, graceful=False)
        raise ExecutorDeadError(reason)

    def close(self) -> None:
        """Stop every worker (idempotent): they leave their process group and exit. Also run
        when the executor is garbage-collected."""
        if self.dead is None:
            self.dead = "the engine was shut down"
        self._stopper()
