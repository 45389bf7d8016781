"""Overlapped scheduling in the scheduler, without a model: plan N+1 is made before
plan N lands. A fake runner keeps each sequence's tokens as a real runner would
(placeholders resolved from the previous launch's samples) and checks every plan;
outputs must equal the synchronous loop's, and no block a launched plan uses may be
free while that plan is in flight."""

import pytest

from deepinfer.scheduler.plan import PLACEHOLDER_TOKEN_ID, SampledToken, StepResult

from .test_scheduler import fake_token, make, outputs, run_all, seqs_for


class RunnerModel:
    """Executes a plan at launch, as the device would: a placeholder is the token this
    runner sampled for the sequence in the previous launch."""

    def __init__(self, sched):
        self.sched = sched
        self.tokens: dict[str, list[int]] = {}      # what the runner knows, in-flight tokens included
        self.last: dict[str, int] = {}              # previous launch's sampled tokens
        self.launched = 0

    def execute(self, plan):
        self.launched += 1
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id)
        for new in plan.new_requests:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        sampled = {}
        result = StepResult()
        for seq in plan.seqs:
            fed = list(seq.token_ids)
            assert (PLACEHOLDER_TOKEN_ID in fed) == seq.placeholder
            if seq.placeholder:
                assert fed.index(PLACEHOLDER_TOKEN_ID) == len(fed) - 1
                fed[-1] = self.last[seq.req_id]
            full = self.tokens[seq.req_id]
            assert fed == full[seq.start_pos:seq.start_pos + len(fed)], seq.req_id
            if seq.sample:
                assert seq.start_pos + len(fed) == len(full)
                base = list(full)
                for rid in [seq.req_id, *seq.fork_ids]:
                    if rid != seq.req_id:
                        self.tokens[rid] = list(base)
                    tok = fake_token(base + [rid.endswith("#1")])
                    self.tokens[rid].append(tok)
                    sampled[rid] = tok
                    result.sampled[rid] = SampledToken(tok, -0.5, None)
        self.last = sampled
        return result


def held_blocks_ok(sched, plan):
    """Every block a launched plan's queries can read is still held (not in the free queue)."""
    for seq in plan.seqs:
        for group, table in zip(sched.kv.groups, seq.block_tables):
            first = 0
            if group.sliding_window is not None:        # the step's first query sees this far back
                first = max(0, seq.start_pos - group.sliding_window + 1) // group.tokens_per_block
            for b in table[first:]:
                assert b != 0, f"{seq.req_id} lost a block its query reads"
                assert sched.kv.pool.ref_cnt[b] > 0, f"block {b} of {seq.req_id} freed in flight"


def run_overlapped(sched, max_steps=2000):
    """The engine's overlapped loop: schedule N+1 while N is in flight unless N's
    sync_reason says otherwise; returns (runner, number of overlapped steps)."""
    runner = RunnerModel(sched)
    in_flight = None
    overlapped = 0
    for _ in range(max_steps):
        if in_flight is None and not sched.has_unfinished:
            assert not sched.has_in_flight
            return runner, overlapped
        overlap = in_flight is not None and in_flight[0].sync_reason is None
        if not overlap and in_flight is not None:
            sched.update(*in_flight)
            in_flight = None
        plan = sched.schedule()
        if in_flight is not None:
            held_blocks_ok(sched, in_flight[0])
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        launched = (plan, runner.execute(plan))
        overlapped += overlap and bool(plan.seqs)
        if in_flight is not None:
            sched.update(*in_flight)
        in_flight = launched if plan.seqs else None
        if in_flight is not None and not sched.has_unfinished:
            sched.update(*in_flight)      # everything in it already ended: land it now
            in_flight = None
    raise AssertionError("did not finish")


def add_all(sched, specs):
    for i, (rid, prompt, kw) in enumerate(specs):
        sched.add(seqs_for(rid, prompt, arrival=i, **kw))


SPECS = [(f"r{i}", list(range(2 + i, 20 + 5 * i)), dict(max_tokens=12 + i)) for i in range(5)]


@pytest.mark.parametrize("window", [None, 4])
def test_overlapped_equals_synchronous(window):
    sync = make(window=window)
    add_all(sync, SPECS)
    run_all(sync)
    over = make(window=window)
    add_all(over, SPECS)
    _, overlapped = run_overlapped(over)
    ids = [rid for rid, _, _ in SPECS]
    assert overlapped > 0
    assert outputs(over, ids) == outputs(sync, ids)
    assert over.kv.num_free_blocks == 63


@pytest.mark.parametrize("window,num_blocks,budget", [(None, 28, 32), (4, 8, 8)])
def test_preemption_under_overlap(window, num_blocks, budget):
    specs = [(f"r{i}", list(range(2 + i, 30 + 3 * i)), dict(max_tokens=20)) for i in range(6)]
    sync = make(num_blocks=num_blocks, budget=budget, window=window)
    add_all(sync, specs)
    run_all(sync)
    over = make(num_blocks=num_blocks, budget=budget, window=window)
    add_all(over, specs)
    run_overlapped(over)
    ids = [rid for rid, _, _ in specs]
    assert over.num_preemptions > 0 and sync.num_preemptions > 0
    assert outputs(over, ids) == outputs(sync, ids)
    assert over.kv.num_free_blocks == num_blocks - 1


def test_stop_token_discards_the_step_in_flight():
    # Fake tokens lie in [10, 60): stopping on [10, 30) ends sequences at unpredictable
    # points, each while its next step is already planned.
    stop = list(range(10, 30))
    specs = [(f"r{i}", list(range(3 + i, 15 + 2 * i)), dict(max_tokens=40)) for i in range(6)]
    sync, over = make(), make()
    for s in (sync, over):
        for i, (rid, prompt, kw) in enumerate(specs):
            seq = seqs_for(rid, prompt, arrival=i, **kw)
            seq[0].params.stop_token_ids = stop
            s.add(seq)
    run_all(sync)
    runner, _ = run_overlapped(over)
    ids = [rid for rid, _, _ in specs]
    assert outputs(over, ids) == outputs(sync, ids)
    assert any(len(v) < 40 for v in outputs(over, ids).values())
    # The runner sampled tokens beyond some sequences' ends; none reached the scheduler.
    assert all(over.requests[i].output_token_ids[-1] in stop or len(over.requests[i].output_token_ids) == 40
               for i in ids)
    assert over.kv.num_free_blocks == 63
    # The runner drops a sequence's state only when no launched plan needs it; the last
    # ones go out with the next plan.
    assert set(runner.tokens) == set(over.schedule().finished_req_ids)


def test_length_limit_is_not_planned_past():
    sched = make()
    sched.add(seqs_for("a", [3, 4, 5], max_tokens=3))
    runner = RunnerModel(sched)
    p1 = sched.schedule()                       # prefill, samples token 1
    r1 = runner.execute(p1)
    p2 = sched.schedule()                       # token 2 fed as a placeholder
    assert p2.seqs[0].placeholder and p2.seqs[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    r2 = runner.execute(p2)
    sched.update(p1, r1)
    p3 = sched.schedule()                       # feeds token 2 (placeholder) -> samples token 3
    r3 = runner.execute(p3)
    sched.update(p2, r2)
    assert sched.schedule().is_empty            # token 3 in flight ends it by max_tokens
    sched.update(p3, r3)
    assert sched.requests["a"].num_output_tokens == 3 and sched.requests["a"].finish_reason == "length"
    assert sched.kv.num_free_blocks == 63


def test_abort_in_flight_defers_free_and_runner_drop():
    sched = make()
    sched.add(seqs_for("a", list(range(2, 20)), max_tokens=50))
    runner = RunnerModel(sched)
    p1 = sched.schedule()
    r1 = runner.execute(p1)
    p2 = sched.schedule()
    r2 = runner.execute(p2)
    sched.abort("a")
    held_blocks_ok(sched, p2)
    sched.update(p1, r1)
    held_blocks_ok(sched, p2)
    assert sched.update(p2, r2) == []
    assert sched.requests["a"].output_token_ids == []   # aborted before any step landed
    assert sched.kv.num_free_blocks == 63
    assert sched.schedule().finished_req_ids == ["a"]


def test_sync_reasons():
    from deepinfer.sampling_params import SamplingParams

    sched = make()
    sched.add(seqs_for("fork", [3, 4, 5], n=2))
    assert sched.schedule().sync_reason == "n > 1 fork"
    sched = make()
    seq = seqs_for("pen", [3, 4, 5])
    seq[0].params = SamplingParams(max_tokens=4, repetition_penalty=1.3)
    sched.add(seq)
    assert sched.schedule().sync_reason == "penalties"
    sched = make()
    seq = seqs_for("plp", [3, 4, 5])
    seq[0].params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    sched.add(seq)
    assert sched.schedule().sync_reason == "prompt logprobs"
    sched = make()
    seq = seqs_for("plain", [3, 4, 5])
    seq[0].params = SamplingParams(max_tokens=4, min_tokens=2, seed=3, logprobs=2, logit_bias={7: 1.0})
    sched.add(seq)
    assert sched.schedule().sync_reason is None


def test_n_greater_than_one_under_overlap():
    specs = [("p", list(range(2, 12)), dict(n=3, max_tokens=6)), ("q", list(range(4, 9)), dict(max_tokens=9))]
    sync, over = make(bs=4), make(bs=4)
    add_all(sync, specs)
    add_all(over, specs)
    run_all(sync)
    run_overlapped(over)
    ids = ["p#0", "p#1", "p#2", "q"]
    assert outputs(over, ids) == outputs(sync, ids)
    assert over.kv.num_free_blocks == 63


def test_waiting_request_waits_for_blocks_of_a_sequence_ending_in_flight():
    # 7 usable blocks of 4 tokens: "w" fits only once "a" has given its blocks back, which
    # happens after a's last (discarded) step lands, not when a is seen to stop.
    sync, over = make(num_blocks=8, bs=4, chunked=False), make(num_blocks=8, bs=4, chunked=False)
    for s in (sync, over):
        a = seqs_for("a", list(range(2, 14)), max_tokens=6)
        a[0].params.stop_token_ids = list(range(10, 60))     # every fake token stops it
        s.add(a)
        s.add(seqs_for("w", list(range(3, 23)), max_tokens=4, arrival=1))
    run_all(sync)
    run_overlapped(over)
    assert outputs(over, ["a", "w"]) == outputs(sync, ["a", "w"])
    assert over.requests["w"].finish_reason == "length"
    assert over.kv.num_free_blocks == 7
