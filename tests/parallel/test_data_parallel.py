"""Attention data parallelism on the CPU (gloo, worker processes): engines at ``ep=2, dp=2``
against the single-process run (greedy tokens equal, float32 logprobs within 1e-5) with a
batch spread over both data-parallel ranks and with one request (the other rank idle, joining
the MoE collectives with dummy forwards); the assignment of requests to ranks (load, shared
prefixes, n > 1); a killed worker failing the requests of both ranks; bad sizes refused before
anything loads."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ParallelConfig
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.models.registry import get_model_class
from deepinfer.parallel.data import DataParallelScheduler
from deepinfer.parallel.executor import dummy_forward
from deepinfer.parallel.expert import ExpertParallelConfig, use_expert_parallel
from tests.engine.conftest import make_checkpoint
from tests.parallel.ep_harness import HF_MOE, HF_TINY, moe_layers, randomize
from tests.parallel.shapes import ENGINE_OPTIONS, LOGPROB_TOL, MOE, TINY_V4, V3
from tests.parallel.workers import kill_and_drain

NEW_TOKENS = 6

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dp")
    return {"Qwen3MoeForCausalLM": make_checkpoint(root, "Qwen3MoeForCausalLM", **MOE),
            "DeepseekV3ForCausalLM": make_checkpoint(root, "DeepseekV3ForCausalLM", **V3),
            "DeepseekV4ForCausalLM": TINY_V4, "DeepseekV41ForCausalLM": Path(DEFAULT_MODEL)}


def _prompts(lens: tuple[int, ...] = (5, 19, 33, 11)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[dict]]]:
    """Greedy tokens with prompt and sample logprobs of ``prompts``, run as one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=3, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:] + o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs


def _run(path: Path, arch: str, **parallel) -> tuple[tuple, tuple, list[int]]:
    """The batch, then one request alone; with data parallelism also how many sequences each
    rank ran during the batch (their schedulers' running lists, sampled every step)."""
    with LLM(model=str(path), device="cpu", max_num_batched_tokens=16, dtype="float32",
             **ENGINE_OPTIONS.get(arch, {}), **parallel) as llm:
        seen = [0, 0]
        sched = llm.engine.scheduler
        if isinstance(sched, DataParallelScheduler):
            step = llm.engine.step

            def counting_step():
                for d, s in enumerate(sched.schedulers):
                    seen[d] = max(seen[d], len(s.running))
                return step()
            llm.engine.step = counting_step
        batch = _generate(llm, _prompts())
        alone = _generate(llm, _prompts((23,)))
    return batch, alone, seen


_reference: dict[str, tuple] = {}


def _assert_close(ref: tuple, got: tuple) -> None:
    ref_tokens, ref_logprobs = ref
    tokens, logprobs = got
    assert tokens == ref_tokens
    for ref_seq, seq in zip(ref_logprobs, logprobs):
        assert len(seq) == len(ref_seq)
        for ref_pos, pos in zip(ref_seq, seq):
            common = ref_pos.keys() & pos.keys()
            assert len(common) >= len(ref_pos) - 1          # the same top tokens, up to ties
            for t in common:
                assert abs(ref_pos[t] - pos[t]) <= LOGPROB_TOL, (t, ref_pos[t], pos[t])


def _check_engine(checkpoints: dict[str, Path], arch: str) -> None:
    if arch not in _reference:
        _reference[arch] = _run(checkpoints[arch], arch)
    ref_batch, ref_alone, _ = _reference[arch]
    batch, alone, seen = _run(checkpoints[arch], arch, expert_parallel_size=2, data_parallel_size=2)
    _assert_close(ref_batch, batch)
    _assert_close(ref_alone, alone)
    assert min(seen) >= 1, f"a data-parallel rank ran no request of the batch: {seen}"


def test_data_parallel_engine_equals_single_process_qwen3_moe(checkpoints):
    _check_engine(checkpoints, "Qwen3MoeForCausalLM")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"])
def test_data_parallel_engine_equals_single_process(checkpoints, arch):
    _check_engine(checkpoints, arch)


@pytest.mark.slow
def test_assignment_by_prefix_load_and_n(checkpoints):
    """Two requests sharing a long prefix land on one rank (also once the first is cached), a
    request without one goes to the less loaded rank, and n > 1 siblings stay together."""
    with LLM(model=str(checkpoints["Qwen3MoeForCausalLM"]), device="cpu", expert_parallel_size=2,
             data_parallel_size=2, dtype="float32") as llm:
        engine, sched = llm.engine, llm.engine.scheduler
        shared = _prompts((48,))[0]
        other = _prompts((7,))[0]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        a = engine.add_request(shared + [5, 6], params)
        b = engine.add_request(other, params)
        c = engine.add_request(shared + [7], params)
        assert sched.rank_of[a] == sched.rank_of[c] != sched.rank_of[b]
        fork = engine.add_request(other, SamplingParams(temperature=0.0, max_tokens=4, n=3, ignore_eos=True))
        assert len({sched.rank_of[f"{fork}#{i}"] for i in range(3)}) == 1
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        assert sorted(outs) == sorted([a, b, c, fork]) and all(o.error is None for o in outs.values())
        assert len(outs[fork].outputs) == 3
        assert not sched.rank_of
        # /metrics sums the ranks' counters.
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        queries = [kv.prefix_queries for kv in engine.kv.managers]
        assert min(queries) > 0 and metrics["vllm:prefix_cache_queries"] == sum(queries)
        assert metrics["vllm:prefix_cache_hits"] == sum(kv.prefix_hits for kv in engine.kv.managers)
        assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] < 1
        server = ServerMetrics("m")
        server.observe_engine(engine)
        assert f'vllm:prefix_cache_queries_total{{model_name="m"}} {float(sum(queries))}' in server.render().decode()
        # Nothing runs now; the shared prefix is cached on one rank only, and a new request
        # sharing it goes there although both ranks are idle.
        d = engine.add_request(shared + [9, 9, 9], params)
        hits = [sched.prefix_hit(r, shared + [9, 9, 9], []) for r in range(2)]
        assert max(hits) >= 32 and min(hits) == 0
        assert sched.rank_of[d] == hits.index(max(hits))
        llm.engine.abort(d)
        while engine.has_unfinished():
            engine.step()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_worker_fails_requests_without_hanging(checkpoints, victim):
    llm = LLM(model=str(checkpoints["Qwen3MoeForCausalLM"]), device="cpu", expert_parallel_size=2,
              data_parallel_size=2)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts()]
    assert {engine.scheduler.rank_of[i] for i in ids} == {0, 1}
    kill_and_drain(llm, ids, engine.runner.pids[victim], victim, params)
    for kv in engine.kv.managers:
        assert kv.num_free_blocks == kv.pool.num_blocks - 1


# -- sizes refused before anything loads ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(expert_parallel_size=3, data_parallel_size=2), ValueError,
     r"ep=3 \(expert_parallel_size\) and tp=1 x dp=2 \(data_parallel_size\) = 2 must divide the world of "
     r"max\(ep, tp x dp\)=3 ranks"),
    (dict(tensor_parallel_size=3, expert_parallel_size=4, data_parallel_size=2), ValueError,
     r"ep=4 .* must divide the world of max\(ep, tp x dp\)=6 ranks"),
    (dict(expert_parallel_size=2, data_parallel_size=2, distributed_executor_backend="external_launcher"),
     NotImplementedError, r"dp=2 \(data_parallel_size\) with distributed_executor_backend='external_launcher'"),
    (dict(data_parallel_size=0), ValueError, r"dp=0 \(data_parallel_size\) must be an int >= 1"),
    (dict(data_parallel_size=2), NotImplementedError,
     r"dp=2 \(data_parallel_size\) without expert parallelism \(expert_parallel_size=1\)"),
])
def test_bad_sizes_are_refused_before_loading(checkpoints, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(model=str(checkpoints["Qwen3MoeForCausalLM"]), device="cpu", **kwargs)
    assert not mp.active_children()


def test_rank_layout():
    par = ParallelConfig(tp=2, ep=8, dp=2)
    assert par.world_size == 8
    # Tensor-parallel groups [0, 1], [2, 3], [4, 5], [6, 7] serve DP ranks 0, 1, 0, 1.
    assert [par.dp_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelConfig(ep=2, dp=2).describe() == (
        "world=2; dp=2 (attention data-parallel rank of ranks 0..1: 0, 1); "
        "ep=2 (expert-parallel groups of ranks [0..1])")
    assert "dp=2 (attention data-parallel rank of ranks 0..7: 0, 0, 1, 1, 0, 0, 1, 1)" in par.describe()
    assert ParallelConfig(tp=2, dp=4, ep=4).world_size == 8


def test_dummy_forward_reaches_every_moe_layer_and_counts_no_load():
    """An idle rank's dummy forward calls every expert-parallel layer once (so it meets the
    other ranks' dispatch and combine) and leaves the load counters as they were."""
    config = {**HF_TINY, **HF_MOE["Qwen3MoeForCausalLM"], "architectures": ["Qwen3MoeForCausalLM"],
              "head_dim": 16}
    # Redundant slots give the layers an ExpertParallel of one rank (filled at random: no load).
    with use_expert_parallel(ExpertParallelConfig(num_redundant_experts=8)):
        model = get_model_class("Qwen3MoeForCausalLM")(config, torch.float32)
    randomize(model, 0)
    layers = moe_layers(model)
    assert layers and all(m.ep is not None for m in layers)
    calls = []
    for i, m in enumerate(layers):
        m.ep.load.copy_(torch.arange(m.ep.load.numel()) + i)
        forward = m.ep.forward
        m.ep.forward = lambda *a, i=i, forward=forward, **k: calls.append(i) or forward(*a, **k)
    before = [m.ep.load.clone() for m in layers]
    dummy_forward(model, torch.device("cpu"))
    assert calls == list(range(len(layers)))
    assert all(torch.equal(m.ep.load, b) for m, b in zip(layers, before))


@pytest.mark.slow
def test_eplb_with_data_parallel_keeps_greedy_tokens(checkpoints):
    """EPLB under data parallelism: each rank counts its own tokens and the balancer sums the
    window over the expert-parallel group (every data-parallel rank), so the placement is the
    whole load's. Rebalancing mid-generation changes no token."""
    path = checkpoints["Qwen3MoeForCausalLM"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(path), device="cpu", max_num_batched_tokens=16, dtype="float32") as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    with LLM(model=str(path), device="cpu", max_num_batched_tokens=16, dtype="float32", expert_parallel_size=2,
             data_parallel_size=2, enable_eplb=True, num_redundant_experts=2, eplb_window_size=4,
             eplb_step_interval=3) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        stats = llm.engine.runner.eplb_stats
    assert got == ref
    assert stats.rebalances >= 2 and stats.imbalance_before >= 1.0


@pytest.mark.slow
def test_preemption_and_abort_under_data_parallel(checkpoints):
    """A rank whose cache cannot hold both its sequences preempts one and recomputes it later
    (greedy tokens unchanged); an aborted request ends as aborted while the others finish."""
    path = checkpoints["Qwen3MoeForCausalLM"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(model=str(path), device="cpu", dtype="float32") as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    # 5 blocks of 16 tokens a rank, one kept back: 4 blocks for two or three sequences of up
    # to 63 tokens each.
    with LLM(model=str(path), device="cpu", dtype="float32", expert_parallel_size=2, data_parallel_size=2,
             num_kv_blocks=5, block_size=16) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in _prompts()]
        victim = engine.add_request(_prompts((9,))[0], SamplingParams(max_tokens=50, ignore_eos=True))
        outs = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            steps += 1
            if steps == 3:
                engine.abort(victim)
        assert [outs[i].outputs[0].token_ids for i in ids] == ref
        assert outs[victim].outputs[0].finish_reason == "abort"
        assert len(outs[victim].outputs[0].token_ids) < 50
        per_rank = [s.num_preemptions for s in engine.scheduler.schedulers]
        assert sum(per_rank) > 0 and engine.scheduler.num_preemptions == sum(per_rank)
        for kv in engine.kv.managers:
            assert kv.num_free_blocks == kv.pool.num_blocks - 1


@pytest.mark.slow
def test_ngram_speculative_decoding_under_data_parallel(checkpoints):
    """Each data-parallel rank drafts and verifies its own sequences (the n-gram drafter runs
    in every worker's runner): greedy tokens equal the single-process run's."""
    path = checkpoints["Qwen3MoeForCausalLM"]
    # Repeating prompts, so that the drafter finds matches.
    prompts = [(p * 3)[:40] for p in _prompts((7, 9, 5, 11))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(model=str(path), device="cpu", dtype="float32") as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(path), device="cpu", dtype="float32", expert_parallel_size=2, data_parallel_size=2,
             speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.scheduler.spec_stats
    assert got == ref
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
