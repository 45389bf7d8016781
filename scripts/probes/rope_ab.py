"""The rope-only kernel (``deepseek_v4_rope._rope_kernel``, contiguous tiles) against the norm
kernel's rope-only variant (strided halves) at DeepSeek-V4-Flash prefill shapes, in one process
on a GPU: the indexer's queries [T, 64, 128] and the attention output's inverse rope
[T, 64, 512], rope width 64. Prints how far apart they are (a bf16 ulp where the GPU compiler fuses a
multiply-add differently), then times both (do_bench, median).

    PYTHONPATH=. python3 scripts/probes/rope_ab.py [--tokens 4096]
"""
from __future__ import annotations

import argparse

import torch
import triton

from deepinfer.kernels import deepseek_v4_rope as k


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    t = args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.arange(t, device="cuda", dtype=torch.int64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    for h, d in ((64, 128), (64, 512)):
        x = torch.randn(t, h, d, device="cuda", generator=gen).to(torch.bfloat16)
        a, b = x.clone(), x.clone()
        k._launch(a, a, pos, inv_freq, 1.0, True, k.NO_NORM, 0.0, None, None, None, "strided")
        k.interleaved_rope_(b, pos, inv_freq, 1.0, inverse=True)
        diff = (a.float() - b.float()).abs().max().item()     # bitwise up to FMA contraction
        old = triton.testing.do_bench(
            lambda: k._launch(a, a, pos, inv_freq, 1.0, True, k.NO_NORM, 0.0, None, None, None, "strided"),
            warmup=50, rep=300, return_mode="median")
        new = triton.testing.do_bench(lambda: k.interleaved_rope_(b, pos, inv_freq, 1.0, inverse=True),
                                      warmup=50, rep=300, return_mode="median")
        moved = 2 * t * h * 64 * 2 / 1e3     # rope channels read and written, bytes -> KB
        print(f"[{t}, {h}, {d}]: strided halves {old * 1e3:7.1f} us, contiguous tile {new * 1e3:7.1f} us "
              f"({moved / (new * 1e3):.0f} GB/s of rope channels), max difference {diff:.3g}")


if __name__ == "__main__":
    main()
