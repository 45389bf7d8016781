"""A worker killed mid-generation, as the tensor- and data-parallel tests do it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer import SamplingParams


def kill_and_drain(llm, ids: list[str], pid: int, victim: int, params: SamplingParams) -> None:
    """Kill worker ``victim`` (process ``pid``) after two steps of ``ids``; every request must
    finish within 60 s with an error naming the dead rank, new requests must be refused, and
    ``close()`` must leave no worker alive."""
    engine = llm.engine
    engine.step()
    engine.step()
    os.kill(pid, signal.SIGKILL)
    finished: dict[str, str | None] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not fail its requests"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.error
    assert sorted(finished) == sorted(ids)
    for error in finished.values():
        assert error is not None and f"worker rank {victim}" in error and "died" in error, error
    with pytest.raises(RuntimeError, match=f"cannot run requests any more: worker rank {victim}"):
        engine.add_request([1, 2, 3], params)
    llm.close()
    assert not any(p.is_alive() for p in engine.runner.procs)
