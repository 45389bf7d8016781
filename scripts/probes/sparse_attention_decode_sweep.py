"""Sparse-attention tile configs at decode sizes (T=1 and 16, contexts 1024 and 8192), timed as
CUDA-graph replays, each checked against the reference.

Run from the repository root on a GPU: python scripts/probes/sparse_attention_decode_sweep.py
(results: docs/BENCHMARKS.md).
"""
import sys, torch, triton
sys.path.insert(0, "scripts")
import gpu_kernel_check as g
from deepinfer.kernels.sparse_attention import SparseAttentionConfig, sparse_attention, default_config
from deepinfer.kernels import reference
DEV, BF16 = "cuda", torch.bfloat16
h, d, bs = 64, 512, 16
for t, context in ((1, 1024), (1, 8192), (16, 1024)):
    names = ('CSA', 'SWA') if (t, context) == (1, 1024) else ('CSA',)
    positions = torch.full((t,), context - 1, device=DEV); seq_of = torch.arange(t, device=DEV)
    blocks = -(-context // bs)
    win, top, _ = g.v4_slots(positions, seq_of, 128, 4, 512, bs, blocks)
    wc, ec = g.v4_caches(t * blocks, bs, [d, d])
    q = torch.randn(t, h, d, device=DEV, dtype=BF16); sinks = torch.randn(h, device=DEV)
    for name, srcs in (("CSA", [(wc, win), (ec, top)]), ("SWA", [(wc, win)])):
        if name not in names: continue
        ref = reference.sparse_attention(q, srcs, sinks, d ** -0.5)
        default = default_config(q, lambda bn: sum(triton.cdiv(s.shape[1], bn) for _, s in srcs))
        us = g.graph_us(lambda: sparse_attention(q, srcs, sinks, d ** -0.5))
        print(f"T={t} ctx={context} {name} default {default.block_h}/{default.block_n}/{default.num_splits}/w{default.num_warps}: {us:.1f} us")
        res = []
        for bh in (16, 32, 64):
            for bn in (16, 32, 64):
                for w in (4, 8):
                    for sp in (8, 16, 32):
                        cfg = SparseAttentionConfig(bh, bn, sp, w, 2)
                        try:
                            out = sparse_attention(q, srcs, sinks, d ** -0.5, cfg)
                            err = (out.float() - ref.float()).abs().max().item()
                            if err > 0.05:
                                print("  BAD", cfg, err); continue
                            res.append((g.graph_us(lambda: sparse_attention(q, srcs, sinks, d ** -0.5, cfg)), bh, bn, w, sp))
                        except Exception as e:
                            pass
        res.sort()
        for r in res[:5]:
            print(f"   {r[0]:.1f} us H{r[1]} N{r[2]} w{r[3]} splits={r[4]}")
