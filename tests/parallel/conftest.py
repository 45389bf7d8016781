"""A guard for every multi-process parallel test: a hang (a collective that never completes)
ends the test process with tracebacks instead of stalling the run."""

from __future__ import annotations

import faulthandler

import pytest

HANG_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
