"""The shared expert inside the routed grouped GEMMs vs beside them (issue 5), on the H200.

One DeepSeek-V4-Flash MoE layer (E=256 routed experts top-6 + 1 shared, H=4096, I=2048, bf16,
routed weights packed with a copy of the shared expert, random weights and tokens): its forward at prefill sizes with the shared
expert as expert E of the routed GEMMs (``fused_moe(shared_expert=True)``) and with the shared expert's
own cuBLAS GEMMs + activation (the decode path). Both in one process, alternated A/B/A/B, each a
CUDA-graph replay of 10 forwards (device time only), and their outputs compared.

    PYTHONPATH=. python3 scripts/probes/shared_expert_fold.py [T ...]
"""

from __future__ import annotations

import statistics
import sys

import torch

from deepinfer.layers import deepseek_v4_moe as moe_mod


def graph_ms(fn, reps: int = 10) -> float:
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
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def main(sizes: list[int]) -> None:
    torch.manual_seed(0)
    layer = moe_mod.DeepseekV4MoE(4096, 2048, 256, 6, "sqrtsoftplus", 1.5, 10.0, None).cuda()
    for p in layer.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    layer.experts.bfloat16()
    layer.shared_experts.bfloat16()
    layer.gate.e_score_correction_bias.normal_(0, 0.1)
    layer.shared_experts.fuse_projections()
    layer.pack_weights()                               # the routed experts with a copy of the shared one
    assert layer.experts.with_shared_expert() is not None
    for t in sizes:
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        ids = torch.zeros(t, dtype=torch.long, device="cuda")

        outs = {}
        for fold in (True, False):
            moe_mod.SHARED_IN_GROUPED_MIN_TOKENS = 1 if fold else 1 << 30
            outs[fold] = layer(x, ids).float()
        diff = (outs[True] - outs[False]).abs().max().item()
        times = {True: [], False: []}
        for _ in range(3):
            for fold in (False, True):
                moe_mod.SHARED_IN_GROUPED_MIN_TOKENS = 1 if fold else 1 << 30
                times[fold].append(graph_ms(lambda: layer(x, ids)))
        sep, fold = statistics.median(times[False]), statistics.median(times[True])
        print(f"T={t:5d}: separate shared expert {sep * 1e3:8.1f} us, in the grouped GEMMs {fold * 1e3:8.1f} us "
              f"({(sep - fold) * 1e3:+.1f} us saved); max |diff| {diff:.3g} of max |out| "
              f"{outs[False].abs().max().item():.3g}; runs {[round(v * 1e3) for v in times[False]]} / "
              f"{[round(v * 1e3) for v in times[True]]}")
    moe_mod.SHARED_IN_GROUPED_MIN_TOKENS = moe_mod.side_stream.MAX_TOKENS + 1


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [512, 1024, 2048, 4096, 8192])
