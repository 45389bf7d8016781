"""layers/side_stream.py off CUDA, and its switch. (That the side-stream forward equals the
single-stream one is checked on the GPU: tests/gpu/test_cuda_graphs.py runs its float32
reference with DEEPINFER_SIDE_STREAM=0 and DEEPINFER_PDL=0, the graphs with both on.)"""

from __future__ import annotations

import pytest
import torch

from deepinfer import env
from deepinfer.layers import side_stream


def test_cpu_tensors_run_inline():
    assert side_stream.fork(torch.randn(4, 8)) is None
    side_stream.join(None)            # no-op
    with side_stream.on(None):
        y = torch.randn(3) * 2
    assert y.shape == (3,)


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (" 0 ", False)])
def test_switch_values(monkeypatch, value, expected):
    monkeypatch.setenv("DEEPINFER_SIDE_STREAM", value)
    assert env.side_stream_enabled() is expected


def test_bad_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SIDE_STREAM", "on")
    with pytest.raises(ValueError, match="DEEPINFER_SIDE_STREAM='on'"):
        env.side_stream_enabled()


def test_lanes_and_marks_run_inline_off_cuda():
    assert side_stream.fork(torch.randn(1000, 8), max_tokens=None, lane="engram") is None
    assert side_stream.mark(None) is None


@pytest.fixture
def ledger(monkeypatch):
    fresh = side_stream.Ledger()
    monkeypatch.setattr(side_stream, "LEDGER", fresh)
    return fresh


class FakeStream:
    """A stand-in side stream: ``on`` only needs a key off CUDA (torch.cuda.stream is then a no-op)."""


def test_memo_entries_of_a_branch_are_read_outside_it_only_after_its_join(ledger):
    memo, a = side_stream.Memo(), FakeStream()
    memo["main"] = 1
    with side_stream.on(a):
        assert ledger.current() is a
        memo["slots"] = 2
        assert memo["slots"] == 2 and memo["main"] == 1      # the branch reads its own and the main's
    assert ledger.current() is None
    with pytest.raises(RuntimeError, match="'slots' was written on a side stream"):
        memo.get("slots")
    with pytest.raises(RuntimeError, match="before side_stream.join"):
        memo["slots"]
    ledger.join(a)
    assert memo.get("slots") == 2 and memo.get("absent") is None


def test_a_partial_join_covers_the_writes_before_its_mark(ledger):
    memo, a = side_stream.Memo(), FakeStream()
    with side_stream.on(a):
        memo["early"] = 1
    upto = ledger.written[a]                    # what mark(a) records in its event
    with side_stream.on(a):
        memo["late"] = 2
    ledger.join(a, upto)
    assert memo["early"] == 1
    with pytest.raises(RuntimeError, match="'late'"):
        memo["late"]


def test_another_lane_may_not_read_an_unjoined_entry(ledger):
    memo, a, b = side_stream.Memo(), FakeStream(), FakeStream()
    with side_stream.on(a):
        memo["k"] = 1
    with side_stream.on(b), pytest.raises(RuntimeError, match="'k'"):
        memo["k"]
    memo["k"] = 3                               # rewritten on the main stream: readable anywhere
    with side_stream.on(b):
        assert memo["k"] == 3


def test_forward_contexts_hold_a_checked_memo():
    from deepinfer.forward_context import ForwardContext
    assert isinstance(ForwardContext.no_cache([3, 2], torch.device("cpu")).memo, side_stream.Memo)


class FakeEvent:
    """A stand-in for mark()'s event: the part of its branch it covers."""

    def __init__(self, side: FakeStream) -> None:
        self.deepinfer_part = (side, side_stream.LEDGER.written.get(side, 0))


def test_v4_forwards_read_no_branch_entry_before_its_join(ledger, monkeypatch):
    """DeepSeek-V4's forwards as they run on a GPU, branches and all (stand-in streams: every
    fork opens a branch, whatever the device; its compressor and indexer branch writes slot
    tables to the memo), prefill chunks and decode steps: no entry a branch wrote is read
    outside it before its join (Memo would raise)."""
    from deepinfer import LLM, SamplingParams
    from tests import TINY_V4_MODEL

    lanes: dict[str, FakeStream] = {}
    forks: list[str] = []

    def fork(x, max_tokens=side_stream.MAX_TOKENS, lane="branch"):
        forks.append(lane)
        return lanes.setdefault(lane, FakeStream())

    def join(side):
        if isinstance(side, FakeEvent):
            ledger.join(*side.deepinfer_part)
        elif side is not None:
            ledger.join(side)

    monkeypatch.setattr(side_stream, "fork", fork)
    monkeypatch.setattr(side_stream, "mark", lambda side: None if side is None else FakeEvent(side))
    monkeypatch.setattr(side_stream, "join", join)
    llm = LLM(model=TINY_V4_MODEL, device="cpu", max_num_batched_tokens=16, block_size=4)
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j + 3) % 200 for j in range(n)]} for i, n in enumerate([9, 23, 4])]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert "branch" in forks and ledger.written, "no branch wrote to the memo: nothing was checked"
