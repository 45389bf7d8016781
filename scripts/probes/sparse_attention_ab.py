"""Sparse attention at an earlier commit against the working tree, in one process on one GPU:
T=4096 prefill (window 128 + top-512, and window only; do_bench, L2 flushed) and decode
batches of 1, 16 and 64 at context 1024 (CUDA-graph replays). Both are checked against
reference.sparse_attention.

Run from the repository root on an H200 (about a minute):
    PYTHONPATH=. python scripts/probes/sparse_attention_ab.py 1ba7e1e
(results: docs/BENCHMARKS.md).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

sys.path.insert(0, "scripts")
import gpu_kernel_check as g  # noqa: E402

from deepinfer.kernels import reference  # noqa: E402
from deepinfer.kernels import sparse_attention as current  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
H, D, BS = 64, 512, 16
SCALE = D ** -0.5


def module_at(rev: str):
    """deepinfer/kernels/sparse_attention.py as of ``rev``, imported under another name."""
    text = subprocess.run(["git", "show", f"{rev}:deepinfer/kernels/sparse_attention.py"],
                          capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "sparse_attention_old.py")   # kept: Triton reads it back
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"sparse_attention_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_us(fn, graph: bool) -> float:
    if graph:
        return do_bench(g.captured(fn).replay, warmup=5, rep=40, return_mode="median") * 1e3
    return do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def case(label: str, t: int, context: int, decode: bool, modules: dict) -> None:
    if decode:       # t sequences, one query each at position context - 1
        seq_of, positions = torch.arange(t, device=DEV), torch.full((t,), context - 1, device=DEV)
    else:            # one sequence of t tokens
        seq_of, positions = torch.zeros(t, dtype=torch.long, device=DEV), torch.arange(t, device=DEV)
    blocks = -(-context // BS)
    win, top, _ = g.v4_slots(positions, seq_of, 128, 4, 512, BS, blocks)
    wc, ec = g.v4_caches(blocks * (int(seq_of.max()) + 1), BS, [D, D])
    q = torch.randn(t, H, D, device=DEV, dtype=BF16)
    sinks = torch.randn(H, device=DEV)
    for name, sources in (("window + top-512", [(wc, win), (ec, top)]), ("window", [(wc, win)])):
        ref = reference.sparse_attention(q, sources, sinks, SCALE).float()
        keys = sum(int((s >= 0).sum()) for _, s in sources)
        for tag, module in modules.items():
            def run(m=module):
                return m.sparse_attention(q, sources, sinks, SCALE)
            err = (run().float() - ref).abs().max().item()
            us = time_us(run, graph=decode)
            print(f"{label} {name:17s} {tag:10s} {us:8.1f} us  {4 * H * D * keys / us / 1e6:6.1f} TFLOP/s"
                  f"  max err {err:.3g}", flush=True)


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    modules = {rev: module_at(rev), "worktree": current}
    case("prefill T=4096", 4096, 4096, False, modules)
    for t in (1, 16, 64):
        case(f"decode T={t}, ctx 1024", t, 1024, True, modules)


if __name__ == "__main__":
    main()
