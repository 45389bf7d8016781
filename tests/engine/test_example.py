"""examples/offline_inference.py runs, and its parallelism flags fail clearly."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offline_inference.py"


def run(*args):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)


def test_example_generates():
    res = run("--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(" -> ") == 4  # three prompts and one chat


def test_example_parallel_flags_need_devices():
    for flag in ("--ep", "--dp", "--cp", "--tp"):
        res = run(flag, "2")
        assert res.returncode != 0
        assert "needs 2 devices" in res.stderr and "not yet supported" in res.stderr
