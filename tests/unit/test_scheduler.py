"""Scheduler policy without a model: a fake runner returns a token that is a
function of the sequence's tokens so far, so outputs can be compared across
schedules."""

import pytest
import torch

from deepinfer.config import SchedulerConfig
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.kv_cache import KVCacheManager, build_groups
from deepinfer.scheduler.plan import SampledToken, StepResult
from deepinfer.scheduler.scheduler import Scheduler

EOS = 1


def make(num_blocks=64, bs=4, max_seqs=8, budget=32, window=None, chunked=True, caching=True):
    spec = KVCacheSpec("sliding" if window else "full", 2, 8, torch.float32, sliding_window=window)
    kv = KVCacheManager(build_groups([spec], bs), num_blocks, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv, max_model_len=512, eos_token_ids=[EOS])


def fake_token(tokens):
    return 10 + (sum((i + 1) * t for i, t in enumerate(tokens)) % 50)


class FakeRunner:
    """Keeps each sequence's tokens as the runner would, and checks the plan."""

    def __init__(self):
        self.seen = {}

    def execute(self, sched, plan):
        for new in plan.new_requests:
            self.seen[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        result = StepResult()
        for seq in plan.seqs:
            req = sched.requests[seq.req_id]
            full = req.all_token_ids
            assert seq.token_ids == full[seq.start_pos:seq.start_pos + len(seq.token_ids)]
            if seq.sample:
                for rid in [seq.req_id, *seq.fork_ids]:
                    tok = fake_token(full + [rid.endswith("#1")])
                    result.sampled[rid] = SampledToken(tok, -0.5, None)
        return result


def seqs_for(rid, prompt, n=1, max_tokens=8, arrival=0):
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return [Request(request_id=rid if n == 1 else f"{rid}#{i}", parent_id=rid, index=i,
                    prompt_token_ids=list(prompt), params=params, arrival=arrival) for i in range(n)]


def run_all(sched, runner=None, max_steps=1000):
    runner = runner or FakeRunner()
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return steps
        plan = sched.schedule()
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(plan.seqs) <= sched.config.max_num_seqs
        steps.append(plan)
        sched.update(plan, runner.execute(sched, plan))
    raise AssertionError("did not finish")


def outputs(sched, ids):
    return {i: list(sched.requests[i].output_token_ids) for i in ids}


def test_budget_and_chunked_prefill():
    sched = make(budget=16)
    sched.add(seqs_for("a", range(2, 42)))  # 40-token prompt -> 3 chunks
    steps = run_all(sched)
    assert [p.num_tokens for p in steps[:3]] == [16, 16, 8]
    assert not steps[0].seqs[0].sample and steps[2].seqs[0].sample
    assert sched.requests["a"].num_output_tokens == 8
    assert sched.kv.num_free_blocks == 63


def test_no_chunking_waits_for_budget():
    sched = make(budget=64, chunked=False)
    sched.add(seqs_for("a", range(2, 42)))
    steps = run_all(sched)
    assert steps[0].num_tokens == 40


def test_batched_equals_alone_and_preemption_keeps_output():
    prompts = {f"r{i}": list(range(2 + i, 30 + 3 * i)) for i in range(6)}
    alone = {}
    for rid, p in prompts.items():
        s = make()
        s.add(seqs_for(rid, p, max_tokens=20))
        run_all(s)
        alone.update(outputs(s, [rid]))
    # Tight cache: forces preemption.
    tight = make(num_blocks=24, budget=32)
    for i, (rid, p) in enumerate(prompts.items()):
        tight.add(seqs_for(rid, p, max_tokens=20, arrival=i))
    run_all(tight)
    assert tight.num_preemptions > 0
    assert outputs(tight, list(prompts)) == alone
    assert tight.kv.num_free_blocks == 23


def test_max_num_seqs():
    sched = make(max_seqs=2)
    for i in range(5):
        sched.add(seqs_for(f"r{i}", [3, 4, 5], arrival=i))
    steps = run_all(sched)
    assert max(len(p.seqs) for p in steps) == 2


def test_abort_returns_blocks():
    sched = make()
    sched.add(seqs_for("a", range(2, 30), max_tokens=100))
    sched.add(seqs_for("b", range(5, 20), max_tokens=100))
    runner = FakeRunner()
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, runner.execute(sched, plan))
    ended = sched.abort("a")
    assert [r.status for r in ended] == [RequestStatus.FINISHED_ABORTED]
    plan = sched.schedule()
    assert "a" in plan.finished_req_ids
    # b is in a launched plan: its blocks come back once that plan lands, its token is dropped.
    sched.abort("b")
    assert sched.kv.num_free_blocks < 63 and not sched.has_unfinished
    assert sched.update(plan, runner.execute(sched, plan)) == []
    assert sched.kv.num_free_blocks == 63
    assert "b" in sched.schedule().finished_req_ids


def test_impossible_prompt_is_refused():
    sched = make(num_blocks=8, bs=4)
    assert "max_model_len" in sched.check_fits(600)
    assert "blocks" in sched.check_fits(100)
    assert sched.check_fits(20) is None


def test_sequence_outgrowing_cache_fails_alone():
    sched = make(num_blocks=6, bs=4)  # 5 blocks = 20 tokens
    sched.add(seqs_for("a", range(2, 12), max_tokens=40))
    run_all(sched)
    a = sched.requests["a"]
    assert a.status == RequestStatus.FINISHED_ERROR and "does not fit" in a.error
    assert sched.kv.num_free_blocks == 5


def test_n_forks_share_prompt_blocks():
    sched = make(bs=4)
    seqs = seqs_for("p", range(2, 12), n=2, max_tokens=5)
    sched.add(seqs)
    runner = FakeRunner()
    plan = sched.schedule()
    assert len(plan.seqs) == 1 and plan.seqs[0].fork_ids == ["p#1"]
    sched.update(plan, runner.execute(sched, plan))
    t0, t1 = sched.kv.block_tables("p#0")[0], sched.kv.block_tables("p#1")[0]
    assert t0[:2] == t1[:2] and t0[2] != t1[2]  # full blocks shared, the partial one copied
    plan = sched.schedule()
    assert plan.block_copies == [(t0[2], t1[2])]
    sched.update(plan, runner.execute(sched, plan))
    run_all(sched, runner)
    o = outputs(sched, ["p#0", "p#1"])
    assert o["p#0"] != o["p#1"] and all(len(v) == 5 for v in o.values())
    assert sched.kv.num_free_blocks == 63


def test_prefix_hit_skips_cached_tokens():
    sched = make(bs=4)
    prompt = list(range(2, 30))
    sched.add(seqs_for("a", prompt))
    run_all(sched)
    sched.add(seqs_for("b", prompt, arrival=1))
    plan = sched.schedule()
    assert plan.seqs[0].start_pos == 24 and sched.requests["b"].num_cached_tokens == 24
    sched.update(plan, FakeRunner().execute(sched, plan))
    run_all(sched)
    assert outputs(sched, ["a"])["a"] == outputs(sched, ["b"])["b"]


@pytest.mark.parametrize("window", [4, 8])
def test_sliding_window_bounded_under_scheduler(window):
    sched = make(num_blocks=12, bs=4, window=window)
    sched.add(seqs_for("a", range(2, 10), max_tokens=200))
    run_all(sched)
    a = sched.requests["a"]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 200
