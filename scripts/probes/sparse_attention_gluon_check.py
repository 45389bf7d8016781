"""The Gluon prefill sparse-attention kernel against the Triton one at T=4096 (window 128 +
top-512, and window only), each checked against the reference: attention alone, and the
attention core with the query's norm + rope and the output's inverse rope (three launches,
or two with the query's norm + rope in the Gluon kernel).

Run from the repository root on an H200: PYTHONPATH=. python scripts/probes/sparse_attention_gluon_check.py
"""
from __future__ import annotations

import sys

from triton.testing import do_bench

sys.path.insert(0, "scripts")
import gpu_kernel_check as g  # noqa: E402

from deepinfer.kernels import deepseek_v4_rope, reference  # noqa: E402
from deepinfer.kernels import sparse_attention as sa  # noqa: E402
from deepinfer.kernels.sparse_attention_gluon import QueryRope, sparse_attention_prefill  # noqa: E402

T, H, D, BS = 4096, 64, 512, 16
case = g.v4_prefill_attention_case(T, BS)
positions, win, top, wc, ec = case["positions"], case["win"], case["top"], case["wc"], case["ec"]
q, sinks, inv_freq, scale = case["q"], case["sinks"], case["inv_freq"], case["scale"]
rope = QueryRope(positions, inv_freq, 1.0, 1e-6)


def chain(attention, sources):
    """q_norm_rope, the attention, the inverse rope: three launches."""
    qn = deepseek_v4_rope.q_norm_rope(q, positions, inv_freq, 1.0, 1e-6)
    return deepseek_v4_rope.interleaved_rope_(attention(qn, sources), positions, inv_freq, 1.0, inverse=True)


def triton_attention(qn, sources):
    return sa.sparse_attention(qn, sources, sinks, scale, sa.default_config(qn, lambda bn: 1 + 640 // bn))


def gluon_attention(qn, sources):
    return sparse_attention_prefill(qn, sources, sinks, scale)


def gluon_prologue(sources):
    """The query's norm + rope inside the Gluon kernel, then the inverse rope: two launches."""
    out = sparse_attention_prefill(q, sources, sinks, scale, rope=rope)
    return deepseek_v4_rope.interleaved_rope_(out, positions, inv_freq, 1.0, inverse=True)


for name, sources in (("window + top-512", [(wc, win), (ec, top)]), ("window", [(wc, win)])):
    keys = sum(int((s >= 0).sum()) for _, s in sources)
    ref = reference.sparse_attention(q, sources, sinks, scale).float()
    ref_rope = reference.rope_attention(q, positions, inv_freq, 1.0, 1e-6, sources, sinks, scale).float()
    config = sa.default_config(q, lambda bn: 1 + 640 // bn)
    runs = {
        "triton attention": (lambda: sa.sparse_attention(q, sources, sinks, scale, config), ref),
        "gluon attention": (lambda: sparse_attention_prefill(q, sources, sinks, scale), ref),
        "triton, 3 launches": (lambda: chain(triton_attention, sources), ref_rope),
        "gluon, 3 launches": (lambda: chain(gluon_attention, sources), ref_rope),
        "gluon q prologue, 2": (lambda: gluon_prologue(sources), ref_rope),
    }
    for tag, (fn, want) in runs.items():
        err = (fn().float() - want).abs().max().item()
        ms = do_bench(fn, warmup=5, rep=40, return_mode="median")
        print(f"{name:17s} {tag:23s} {ms * 1e3:8.1f} us {4 * H * D * keys / ms / 1e9:6.1f} TFLOP/s "
              f"max err {err:.3g}", flush=True)
