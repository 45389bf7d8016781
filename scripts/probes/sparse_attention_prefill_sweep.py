"""Sparse-attention tile configs at T=4096 prefill (window 128 + top-512, and window only), timed
with do_bench, each checked against the reference.

Run from the repository root on a GPU: python scripts/probes/sparse_attention_prefill_sweep.py
(results: docs/BENCHMARKS.md).
"""
import sys, torch, triton
sys.path.insert(0, "scripts")
import gpu_kernel_check as g
from triton.testing import do_bench
from deepinfer.kernels.sparse_attention import SparseAttentionConfig, sparse_attention, default_config
from deepinfer.kernels import reference
DEV, BF16 = "cuda", torch.bfloat16
t, h, d, bs = 4096, 64, 512, 16
positions = torch.arange(t, device=DEV); seq_of = torch.zeros(t, dtype=torch.long, device=DEV)
blocks = -(-t // bs)
win, top, _ = g.v4_slots(positions, seq_of, 128, 4, 512, bs, blocks)
wc, ec = g.v4_caches(blocks, bs, [d, d])
q = torch.randn(t, h, d, device=DEV, dtype=BF16); sinks = torch.randn(h, device=DEV)
real_keys = (win >= 0).sum().item() + (top >= 0).sum().item()
flops = 4 * h * d * real_keys
print(f"real keys/token {real_keys / t:.0f}; {flops/1e9:.0f} GFLOP")
for name, srcs in (("CSA", [(wc, win), (ec, top)]), ("SWA", [(wc, win)])):
    ref = reference.sparse_attention(q, srcs, sinks, d ** -0.5)
    rk = sum((s >= 0).sum().item() for _, s in srcs); fl = 4 * h * d * rk
    default = default_config(q, lambda bn: sum(triton.cdiv(s.shape[1], bn) for _, s in srcs))
    print(name, "default", default)
    res = []
    if name == "CSA":
        grid = [(bh, bn, w, st) for bh in (32, 64) for bn in (32, 64) for w in (4, 8, 16) for st in (1, 2, 3)]
        grid += [(64, 128, 8, 1), (64, 128, 16, 1), (64, 128, 8, 2), (64, 128, 16, 2), (16, 64, 4, 2)]
    else:
        grid = best
    for bh, bn, w, st in grid:
                    cfg = SparseAttentionConfig(bh, bn, 1, w, st)
                    try:
                        out = sparse_attention(q, srcs, sinks, d ** -0.5, cfg)
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = do_bench(lambda: sparse_attention(q, srcs, sinks, d ** -0.5, cfg), warmup=5, rep=30, return_mode="median")
                        res.append((ms, bh, bn, w, st, err))
                    except Exception as e:
                        print(f"  H{bh} N{bn} w{w} s{st}: {type(e).__name__}")
    res.sort()
    best = [r[1:5] for r in res[:6]]
    for ms, bh, bn, w, st, err in res[:12]:
        print(f"  {name} H{bh} N{bn} w{w} s{st}: {ms*1e3:8.1f} us {fl/ms/1e9:6.1f} TFLOP/s err {err:.3g}")
    d_ms = do_bench(lambda: sparse_attention(q, srcs, sinks, d ** -0.5), warmup=5, rep=30, return_mode="median")
    print(f"  {name} default: {d_ms*1e3:.1f} us {fl/d_ms/1e9:.1f} TFLOP/s")
