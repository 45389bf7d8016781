"""The persistent down GEMM of the routed experts (``MoEConfig.persistent2``: one program per SM
walking the tiles in one flattened loop, so the weight stream's pipeline runs on across tile
boundaries) in a few stage / group / tile configs, against one program per tile, at prefill sizes on DeepSeek-V4-Flash widths: E=256, K=6, H=4096,
I=2048, bf16, packed weights, swiglu_limit 10, random routing (sqrtsoftplus top-6).

For each T: gate_up (moe_gate_up) and down (moe_down) timed alone and the whole fused_moe, each as
CUDA-graph replays of 10 calls (device time only), the configs alternated over 3 rounds (median);
each config's output is checked bitwise against the default's. (The same flattened loop for
gate_up measured slower: 2,452-2,727 us against 2,255 us at T=4096, first run of this probe.) Rates are the touched experts'
weight bytes over the time, beside the copy rate measured here (read + write).

    PYTHONPATH=. python3 scripts/probes/fused_moe_persistent.py [T ...] [--ab ROUNDS]

``--ab ROUNDS``: only the default against one program a tile, over ROUNDS alternated rounds.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from deepinfer.bench.floors import measure_hbm_bandwidth
from deepinfer.kernels import reference
from deepinfer.kernels.fused_moe import (DOWN_TILE, GATE_UP_TILE, fused_moe, moe_align, moe_down, moe_gate_up,
                                         pack_expert_weights, pick_config)

E, K, H, I, LIMIT = 256, 6, 4096, 2048, 10.0


def graph_us(fn, reps: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


@torch.inference_mode()
def main(sizes: list[int], ab_rounds: int = 0) -> None:
    copy = measure_hbm_bandwidth(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = pack_expert_weights((torch.randn(E, 2 * I, H, device="cuda", generator=gen) / 64).bfloat16(),
                                  *GATE_UP_TILE)
    down = pack_expert_weights((torch.randn(E, H, I, device="cuda", generator=gen) / 45).bfloat16(), *DOWN_TILE)
    print(f"copy rate {copy:.0f} GB/s")
    for t in sizes:
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        weights, ids = reference.biased_topk(torch.randn(t, E, device="cuda", generator=gen),
                                             torch.zeros(E, device="cuda"), K, "sqrtsoftplus", 1.5)
        touched = int(torch.unique(ids).numel())
        base = pick_config(t, K, E, H, I)
        plain = dataclasses.replace(base, persistent2=False, num_stages2=None, group_m2=None)
        configs = {"default": base, "one program a tile": plain}
        sweep = () if ab_rounds else ((3, 1, 256), (2, 1, 256), (3, 4, 256), (4, 1, 256), (3, 1, 128),
                                      (4, 1, 128))
        for stages, group_m, block_n2 in sweep:
            configs[f"persistent s{stages} g{group_m} n{block_n2}"] = dataclasses.replace(
                base, persistent2=True, num_stages2=stages, group_m2=group_m, block_n2=block_n2)
        expect = fused_moe(x, gate_up, down, weights, ids, LIMIT, config=base, packed=True)
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
        for name, cfg in list(configs.items()):
            try:
                got = fused_moe(x, gate_up, down, weights, ids, LIMIT, config=cfg, packed=True)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                print(f"T={t} {name}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                del configs[name], times[name]
                continue
            if not torch.equal(got, expect):
                print(f"T={t} {name}: NOT bitwise equal to the default (max diff "
                      f"{(got.float() - expect.float()).abs().max().item():.3g})")
        for _ in range(ab_rounds or 3):
            for name, cfg in configs.items():
                out = torch.empty(t * K, H, dtype=x.dtype, device="cuda")
                sp, be, npad = moe_align(ids, E, cfg.block_m, out)
                act = moe_gate_up(x, gate_up, sp, be, npad, K, LIMIT, cfg, packed=True)
                gu = graph_us(lambda: moe_gate_up(x, gate_up, sp, be, npad, K, LIMIT, cfg, packed=True))
                dn = graph_us(lambda: moe_down(act, down, weights, sp, be, npad, out, cfg, packed=True))
                whole = graph_us(lambda: fused_moe(x, gate_up, down, weights, ids, LIMIT, config=cfg, packed=True))
                times[name].append((gu, dn, whole))
        gu_bytes, dn_bytes = touched * 2 * I * H * 2, touched * H * I * 2
        for name, runs in times.items():
            gu, dn, whole = (statistics.median(r[j] for r in runs) for j in range(3))
            print(f"T={t} {name:26s} gate_up {gu:7.1f} us ({gu_bytes / gu / 1e3:5.0f} GB/s)  down {dn:7.1f} us "
                  f"({dn_bytes / dn / 1e3:5.0f} GB/s)  fused_moe {whole:7.1f} us; down per round "
                  f"{[round(r[1]) for r in runs]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    rounds = 0
    if "--ab" in args:                       # --ab N: only the default against one program a tile, N rounds
        i = args.index("--ab")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    main([int(a) for a in args] or [4096], rounds)
