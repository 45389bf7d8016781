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


def make(num_blocks=64, bs=4, max_seqs=8, budget=32, window=None, chunked=True, caching=True,
         replay_keep=None):
    spec = KVCacheSpec("sliding" if window else "full", 2, 8, torch.float32, sliding_window=window)
    kv = KVCacheManager(build_groups([spec], bs), num_blocks, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv, max_model_len=512, eos_token_ids=[EOS], replay_keep_tokens=replay_keep)


def fake_token(tokens):
    return 10 + (sum((i + 1) * t for i, t in enumerate(tokens)) % 50)


class FakeRunner:
    """Keeps each sequence's tokens as the runner would, and checks the plan."""

    def __init__(self):
        self.seen = {}
        self.replay_starts = {}   # req_id -> replay_start of every new-request data sent for it

    def execute(self, sched, plan):
        for new in plan.new_requests:
            self.seen[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.replay_starts.setdefault(new.req_id, []).append(new.replay_start)
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


def seqs_for(rid, prompt, n=1, max_tokens=8, arrival=0, prompt_logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, prompt_logprobs=prompt_logprobs)
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


# -- bounded replay (YOCO prefill truncation) ---------------------------------------------
def test_replay_start_is_the_prompt_minus_keep():
    sched = make(replay_keep=10)
    sched.add(seqs_for("long", range(2, 32)))                          # 30 tokens
    sched.add(seqs_for("short", range(2, 8), arrival=1))               # 6 < keep: every layer
    sched.add(seqs_for("logprobs", range(2, 32), arrival=2, prompt_logprobs=1))
    runner = FakeRunner()
    run_all(sched, runner)
    starts = {rid: sched.requests[rid].replay_start for rid in ("long", "short", "logprobs")}
    assert starts == {"long": 20, "short": 0, "logprobs": 0}
    assert runner.replay_starts == {rid: [v] for rid, v in starts.items()}

    off = make()
    off.add(seqs_for("long", range(2, 32)))
    assert off.requests["long"].replay_start == 0


def test_replay_start_survives_preemption_and_outputs_do_not_change():
    prompts = {f"r{i}": list(range(2 + i, 30 + 3 * i)) for i in range(6)}
    alone = {}
    for rid, p in prompts.items():
        s = make(replay_keep=7)
        s.add(seqs_for(rid, p, max_tokens=20))
        run_all(s)
        alone.update(outputs(s, [rid]))
    tight = make(num_blocks=24, budget=32, replay_keep=7)
    for i, (rid, p) in enumerate(prompts.items()):
        tight.add(seqs_for(rid, p, max_tokens=20, arrival=i))
    hits = []          # (req_id, replay_start, hit) of every admission, resumes included
    find = tight.kv.find_prefix_hit

    def recording_find(req_id, tokens, max_tokens=None):
        hit = find(req_id, tokens, max_tokens)
        hits.append((req_id, tight.requests[req_id].replay_start, hit))
        return hit

    tight.kv.find_prefix_hit = recording_find
    runner = FakeRunner()
    run_all(tight, runner)
    assert tight.num_preemptions > 0
    assert outputs(tight, list(prompts)) == alone
    for rid, p in prompts.items():
        assert tight.requests[rid].replay_start == len(p) - 7
        # The runner keeps its state across preemption: the value is sent once.
        assert runner.replay_starts[rid] == [len(p) - 7]
    resumed = [h for h in hits if tight.requests[h[0]].num_preemptions and h[2]]
    assert resumed, "no preempted sequence resumed from the prefix cache"
    assert all(hit <= start for _, start, hit in hits)


def test_n_siblings_share_the_parents_replay_start():
    sched = make(replay_keep=4)
    sched.add(seqs_for("p", range(2, 13), n=3, max_tokens=5))           # 11 tokens
    runner = FakeRunner()
    run_all(sched, runner)
    assert [sched.requests[f"p#{i}"].replay_start for i in range(3)] == [7, 7, 7]
    assert runner.replay_starts == {f"p#{i}": [7] for i in range(3)}


@pytest.mark.parametrize("keep,hit", [(None, 28), (8, 20), (9, 20), (12, 16), (29, 0), (40, 0)])
def test_prefix_hit_stops_at_replay_start(keep, hit):
    """A second identical 29-token prompt (block size 4): without truncation it hits 28
    tokens; with it, at most its replay_start (29 - keep), floored to whole blocks, and
    nothing at all for a prompt shorter than keep."""
    sched = make(bs=4, replay_keep=keep)
    prompt = list(range(2, 31))
    sched.add(seqs_for("a", prompt))
    run_all(sched)
    sched.add(seqs_for("b", prompt, arrival=1))
    plan = sched.schedule()
    b = sched.requests["b"]
    assert b.replay_start == (0 if keep is None else max(0, 29 - keep))
    assert plan.seqs[0].start_pos == hit and b.num_cached_tokens == hit
    sched.update(plan, FakeRunner().execute(sched, plan))
    run_all(sched)
    assert outputs(sched, ["a"])["a"] == outputs(sched, ["b"])["b"]


def test_prefix_counters_count_each_admission_once():
    """A request that waits for budget is looked up again each step, but the counters take
    its prompt once, when it is admitted (queries and hits in tokens, as vLLM's)."""
    sched = make(budget=16, chunked=False, max_seqs=8)
    shared = list(range(2, 14))                          # 12 tokens: 3 blocks of 4
    sched.add(seqs_for("a", shared + [50, 51], max_tokens=2))
    run_all(sched)
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (14, 0)
    # "b" (16 tokens) waits behind "c" (14 tokens, unchunked, the budget is 16) for a few steps.
    sched.add(seqs_for("c", list(range(100, 114)), max_tokens=3, arrival=1))
    sched.add(seqs_for("b", shared + [60, 61, 62, 63], max_tokens=2, arrival=2))
    run_all(sched)
    assert sched.kv.prefix_queries == 14 + 14 + 16
    assert sched.kv.prefix_hits == 12
