"""Property-based fuzzing of every operation in /openapi.json with schemathesis
(its CLI, in a subprocess): no input may produce a 5xx. Bounded by examples per
operation and a wall-clock limit; the server's short context keeps each
generation cheap."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import make_engine, serve


@pytest.mark.slow        # ~40 s: property-based requests against the whole API
def test_no_server_errors(tmp_path: Path):
    engine = make_engine(max_model_len=24, max_num_batched_tokens=256)
    schemathesis = Path(sys.executable).with_name("schemathesis")
    with serve(engine) as server:
        cmd = [str(schemathesis), "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", "20", "--seed", "1", "--no-shrink", "--generation-database", "none",
               "--request-timeout", "30", "--no-color"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                              env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
        assert server.pool_is_full()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # Every generated case passed (warnings, e.g. that most random token ids are refused, are fine).
    summary = re.search(r"(\d+) generated, (\d+) passed", out)
    assert summary and summary.group(1) == summary.group(2) and int(summary.group(1)) > 500, out[-3000:]
    assert "7 selected / 7 total" in out
