"""Stacked against tile-packed expert weights (kernels/fused_moe.py, ``packed=True``) on
DeepSeek-V4-Flash widths: E=256, K=6, H=4096, I=2048, bf16, swiglu_limit 10, random routing
(sqrtsoftplus top-6).

The stacked weights are read by the prefill TMA boxes as 128 rows of 128 bytes 4-8 KB apart;
packed (``pack_expert_weights`` in GATE_UP_TILE / DOWN_TILE tiles, what the layers store on
CUDA since after_load packs them) each box is one contiguous run, and the decode configs'
pointer loads read 4 KB runs of a tile. For T in 1, 16, 64 (decode and medium configs) and 4096
(prefill) this times the whole fused_moe with pick_config's config on both layouts: CUDA-graph
replays of 20 calls for the small T, triton.testing.do_bench (L2 flushed) at T=4096, where
gate_up (moe_gate_up) and down (moe_down) are also timed alone. Rates are the touched experts'
weight bytes / time, against a 4 GiB device-to-device copy_ measured here (read + write bytes).
Each T also checks that the two layouts give bitwise the same output.

Run from the repository root on an H200 (under a minute, mostly Triton compiles; 26 GB of
weights on the device):
    PYTHONPATH=. python3 scripts/probes/fused_moe_packed.py
"""
from __future__ import annotations

import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, "scripts")
import gpu_kernel_check as g  # noqa: E402

from deepinfer.bench.floors import measure_hbm_bandwidth  # noqa: E402
from deepinfer.kernels import reference  # noqa: E402
from deepinfer.kernels.fused_moe import (  # noqa: E402
    DOWN_TILE,
    GATE_UP_TILE,
    fused_moe,
    moe_align,
    moe_down,
    moe_gate_up,
    pack_expert_weights,
    pick_config,
)

START = time.time()
E, K, H, I, LIMIT = 256, 6, 4096, 2048, 10.0
TOKENS = (1, 16, 64, 4096)
GRAPH_REPS = 20
DEV, BF16 = "cuda", torch.bfloat16


def time_us(fn, t: int) -> float:
    """Median device time of one call: CUDA-graph replays for decode-sized T (launch overhead
    out of the way, as the engine runs them), do_bench with the L2 flushed otherwise."""
    if t <= 64:
        return g.graph_us(fn, GRAPH_REPS)
    return do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def rate(weight_bytes: int, us: float, copy: float) -> str:
    gbps = weight_bytes / us / 1e3
    return f"{gbps:5.0f} GB/s ({gbps / copy:4.0%} of copy)"


def gemm_breakdown(x, stacked, packed, weights, ids, copy: float, touched: int) -> None:
    """gate_up and down alone at T=4096, each layout, with the prefill config."""
    t = x.shape[0]
    cfg = pick_config(t, K, E, H, I)
    out = torch.empty(t * K, H, dtype=BF16, device=DEV)
    sorted_pairs, block_expert, num_padded = moe_align(ids, E, cfg.block_m, out)
    gu_bytes, dn_bytes = touched * 2 * I * H * 2, touched * H * I * 2
    for name, (gate_up, down), flag in (("stacked", stacked, False), ("packed", packed, True)):
        act = moe_gate_up(x, gate_up, sorted_pairs, block_expert, num_padded, K, LIMIT, cfg, flag)
        us_gu = do_bench(lambda: moe_gate_up(x, gate_up, sorted_pairs, block_expert, num_padded, K, LIMIT,
                                             cfg, flag), warmup=5, rep=40, return_mode="median") * 1e3
        us_dn = do_bench(lambda: moe_down(act, down, weights, sorted_pairs, block_expert, num_padded, out,
                                          cfg, flag), warmup=5, rep=40, return_mode="median") * 1e3
        print(f"    {name:7s} gate_up {us_gu:7.0f} us {rate(gu_bytes, us_gu, copy)}   down {us_dn:7.0f} us "
              f"{rate(dn_bytes, us_dn, copy)}   both {us_gu + us_dn:7.0f} us "
              f"{rate(gu_bytes + dn_bytes, us_gu + us_dn, copy)}", flush=True)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; E={E} K={K} H={H} I={I} bf16, swiglu_limit {LIMIT}; "
          f"tiles gate_up {GATE_UP_TILE}, down {DOWN_TILE}")
    copy = measure_hbm_bandwidth(torch.device(DEV), 4 << 30)
    print(f"copy rate {copy:.0f} GB/s")
    gen = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, device=DEV, dtype=BF16, generator=gen) / H ** 0.5
    down = torch.randn(E, H, I, device=DEV, dtype=BF16, generator=gen) / I ** 0.5
    stacked = (gate_up, down)
    packed = (pack_expert_weights(gate_up, *GATE_UP_TILE), pack_expert_weights(down, *DOWN_TILE))
    all_equal = True
    for t in TOKENS:
        x = torch.randn(t, H, device=DEV, dtype=BF16, generator=gen)
        weights, ids = reference.biased_topk(torch.randn(t, E, device=DEV, generator=gen),
                                             torch.zeros(E, device=DEV), K, "sqrtsoftplus", 1.5)
        touched = int((torch.bincount(ids.flatten(), minlength=E) > 0).sum())
        weight_bytes = touched * 3 * H * I * 2
        outs, times = {}, {}
        for name, (gu, dn), flag in (("stacked", stacked, False), ("packed", packed, True)):
            def run(gu=gu, dn=dn, flag=flag) -> torch.Tensor:
                return fused_moe(x, gu, dn, weights, ids, LIMIT, packed=flag)
            outs[name] = run().clone()
            times[name] = time_us(run, t)
        equal = torch.equal(outs["stacked"], outs["packed"])
        all_equal &= equal
        s_us, p_us = times["stacked"], times["packed"]
        print(f"T={t:5d} ({touched} experts, {weight_bytes / 1e9:.2f} GB of weights; "
              f"{'graph' if t <= 64 else 'do_bench'}) {pick_config(t, K, E, H, I)}")
        print(f"    fused_moe stacked {s_us:8.1f} us {rate(weight_bytes, s_us, copy)}   "
              f"packed {p_us:8.1f} us {rate(weight_bytes, p_us, copy)}   "
              f"packed/stacked {p_us / s_us:.3f}   bitwise equal {equal}", flush=True)
        if t == 4096:
            gemm_breakdown(x, stacked, packed, weights, ids, copy, touched)
    print(f"all outputs bitwise equal: {all_equal}; {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
