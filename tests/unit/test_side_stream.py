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
