"""The first connection of DeepSeek-V4 on n written copies of the embedding against the copies
left as a stride-0 view. V4-Flash widths at T=4096: the embedding gather, hc_pre
with the block's norm (projection + collapse launches) and hc_post, bf16, each variant as CUDA-
graph replays in one process, alternated twice; outputs compared bit for bit.

    PYTHONPATH=. python3 scripts/probes/stream_copies_ab.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

from deepinfer.kernels import hyper_connection as hc

DEV, BF16 = "cuda", torch.bfloat16
T, N, D, V = 4096, 4, 4096, 129280


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    embed = torch.randn(V, D, device=DEV, dtype=BF16, generator=g)
    ids = torch.randint(0, V, (T,), device=DEV, generator=g)
    fn = torch.randn(24, N * D, device=DEV, generator=g) * 4 / (N * D) ** 0.5
    base, scale = torch.randn(24, device=DEV, generator=g), torch.rand(3, device=DEV, generator=g) + 0.5
    norm = (torch.rand(D, device=DEV, generator=g) + 0.5, 1e-6)
    block_out = torch.randn(T, D, device=DEV, dtype=BF16, generator=g)

    def written():
        s = torch.nn.functional.embedding(ids[:, None].expand(-1, N), embed)          # [T, n, D]
        x, post, comb = hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, norm=norm)
        return x, hc.hc_post(block_out, s, post, comb)

    def view():
        s = torch.nn.functional.embedding(ids, embed)[:, None, :].expand(-1, N, -1)
        x, post, comb = hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, norm=norm)
        return x, hc.hc_post(block_out, s, post, comb)

    a, b = written(), view()
    print("bitwise equal:", all(torch.equal(u, v) for u, v in zip(a, b)))
    runs = {"written copies": written, "stride-0 view": view}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(2):
        for name, fn_ in runs.items():
            times[name].append(do_bench(fn_, warmup=10, rep=100, return_mode="median") * 1e3)
    for name, ts in times.items():
        print(f"{name:15s} {min(ts):8.1f} us (rounds {' / '.join(f'{x:.1f}' for x in ts)})")


if __name__ == "__main__":
    main()
