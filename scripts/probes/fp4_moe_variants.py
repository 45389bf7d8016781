"""The FP4 MoE kernels' variants (kernels/fp4_moe.py) timed at DeepSeek-V4-Flash widths: E=256,
K=6, H=4096, I=2048, bf16 activations, swiglu_limit 10, random routing (each token's K experts
drawn uniformly, so the expert load is even), random packed e2m1 bytes with UE8M0 scales (and one
float32-scale row a T).

For each T in 1, 16, 64, 4096: the default kernel (fp4_pick_kernel at fp4_pick_config's tiles),
the group path's variants (dot type, groups a K step, where the scale is applied, the decode
through e4m3 or straight to bf16 bits, inline PTX or not, one load and dot a K step or one a
group, a few tile shapes) and the dequant path, each one line: microseconds (CUDA events, median of 20 CUDA-graph
replays after warm-up, the L2 evicted before each; the whole fp4_moe, routing sort, activation
quantisation and slot sum included), the bytes that must move
(the distinct experts touched times their packed weights and scales, plus x, act, the slot
outputs and the result), the achieved GB/s over them, and the largest error against the
reference (reference.fp4_moe_experts for bf16 dots, reference.fp4_moe_experts_fp8 for FP8 dots)
relative to the reference's largest magnitude. The last lines name the fastest variant per T.
A variant that fails to compile or run prints its error and the sweep goes on.

On an H100 or H200, from the repository root (about 3 minutes, mostly Triton compiles; stops
timing after BUDGET_S and names what it skipped):
    PYTHONPATH=. python scripts/probes/fp4_moe_variants.py            # writes $OUT/fp4_moe_variants.txt too
    PROBE_TOKENS=1,16 PROBE_MATCH=bits,weight32 PYTHONPATH=. python scripts/probes/fp4_moe_variants.py   # some
On the CPU (Triton interpreter, tiny widths, a handful of variants; checks the script runs):
    PYTHONPATH=. python scripts/probes/fp4_moe_variants.py --dry-run
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("DEEPINFER_PDL", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from deepinfer.kernels import reference  # noqa: E402
from deepinfer.kernels.fp4_moe import FP4Kernel, fp4_moe, fp4_pick_config, fp4_pick_kernel  # noqa: E402
from deepinfer.kernels.fused_moe import MoEConfig  # noqa: E402
from scripts.gpu_kernel_check import captured  # noqa: E402

START = time.time()
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "170"))      # seconds of timing before it stops
if DRY:
    E, K, H, I, TS, DEV = 8, 2, 128, 128, (1, 16), "cpu"
else:
    E, K, H, I, DEV = 256, 6, 4096, 2048, "cuda"
    # PROBE_TOKENS="4096" (comma-separated) times only those token counts.
    TS = tuple(int(t) for t in os.environ.get("PROBE_TOKENS", "1,16,64,4096").split(","))
LIMIT = 10.0
LINES: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def experts(scale_format: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Random packed bytes (every e2m1 code equally likely) and scales near 2^-6 (the magnitude of
    N(0, 1/sqrt(H)) weights quantised per 32): UE8M0 bytes 118..122, or float32 in [2^-8, 2^-5)."""
    def one(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device=DEV, generator=gen)
        if scale_format == "ue8m0":
            s = torch.randint(118, 123, (E, n, k // 32), dtype=torch.uint8, device=DEV, generator=gen)
        else:
            s = torch.exp2(torch.rand(E, n, k // 32, device=DEV, generator=gen) * 3 - 8)
        return q, s
    return [*one(2 * I, H), *one(H, I)]


def moved_bytes(t: int, ids: torch.Tensor, weights: list[torch.Tensor]) -> int:
    touched = ids.unique().numel()
    per_expert = sum(w[0].numel() * w.element_size() for w in weights)
    act = t * K * I * 2 * 2                                   # written by gate_up, read by down
    return touched * per_expert + t * H * 2 + act + t * K * H * 2 * 2 + t * H * 2


def time_us(fn) -> float:
    """Median of 20 timed runs after warm-up. On CUDA each run is one replay of a CUDA graph of
    ``fn`` (so host launch overhead is out, as in serving's decode graphs) after a 256 MB write
    that evicts the L2 (so no run finds the previous run's weights there)."""
    for _ in range(2):
        fn()
    if DRY:
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(runs)
    graph = captured(fn)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    runs = []
    for _ in range(20):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) * 1e3)
    return statistics.median(runs)


def variants(t: int) -> list[tuple[str, MoEConfig, FP4Kernel]]:
    """(name, tiles, kernel) for T: the default (fp4_pick_kernel at fp4_pick_config's tiles)
    first, the newest variants next, the dequant path last. PROBE_MATCH (comma-separated) keeps
    the variants whose names contain one of its parts, and the default."""
    base = fp4_pick_config(t, K, E, H, I)
    rep = dataclasses.replace
    # The layers' pick for these scales (the interpreter's activations are fp16: e4m3 there).
    default = ("default", base, fp4_pick_kernel(base, bf16_bits=not DRY))
    dequant = ("dequant", base, FP4Kernel(path="dequant"))
    if DRY:
        return [default, ("bf16 g2 dot", base, FP4Kernel()), ("bf16 g1 weight", base, FP4Kernel(groups=1, scale="weight")),
                ("bf16 g2 weight wide", base, FP4Kernel(scale="weight", wide=True)),
                ("fp8 g2 a32", base, FP4Kernel(dot="fp8")),
                ("fp8 g4 a128", base, FP4Kernel(dot="fp8", groups=4, act_group=128)), dequant]
    split = FP4Kernel(groups=2, scale="weight", wide=True, split=True)
    if base.block_m <= 32:                                    # decode: weight streaming
        wide = rep(base, block_n1=64, block_n2=128)
        split4 = rep(split, groups=4)
        bits4 = rep(split4, decode="bf16")
        out = [
            # The default kernel (bf16 bits, 4 groups a step) over tile shapes, warps and stages.
            # ... and with the next K step's bytes loaded a step ahead (a register double buffer).
            ("bits g4 prefetch", base, rep(bits4, prefetch=True)),
            ("bits g4 prefetch s2", rep(base, num_stages=2), rep(bits4, prefetch=True)),
            ("bits g4 prefetch n16/32", rep(base, block_n1=16, block_n2=32), rep(bits4, prefetch=True)),
            ("bits g8 prefetch", base, rep(bits4, groups=8, prefetch=True)),
            ("bits g2 prefetch", base, rep(bits4, groups=2, prefetch=True)),
            ("bits g4 tiles n16/32", rep(base, block_n1=16, block_n2=32), bits4),
            ("bits g4 tiles n64/128", wide, bits4),
            ("bits g4 tiles n32/32", rep(base, block_n2=32), bits4),
            ("bits g4 tiles n16/64", rep(base, block_n1=16), bits4),
            ("bits g4 tiles s2", rep(base, num_stages=2), bits4),
            ("bits g4 tiles s4", rep(base, num_stages=4), bits4),
            ("bits g4 tiles s5", rep(base, num_stages=5), bits4),
            ("bits g4 tiles w2", rep(base, num_warps=2), bits4),
            ("bits g4 tiles w8", rep(base, num_warps=8), bits4),
            ("bits g8 tiles", base, rep(bits4, groups=8)),
            ("bits g8 tiles s2", rep(base, num_stages=2), rep(bits4, groups=8)),
            ("bits g2 tiles s4", rep(base, num_stages=4), rep(bits4, groups=2)),
            ("e4m3 g4 weight split", base, split4),
            ("bits g4 weight32 split", base, rep(split4, scale="weight32", decode="bf16")),
            ("e4m3 g4 weight32 split", base, rep(split4, scale="weight32")),
            ("bits g2 weight split", base, rep(split, decode="bf16")),
            ("bf16 g2 weight split", base, split),
            ("bf16 g2 weight split n64/128", wide, split),
            ("bf16 g2 weight split s4", rep(base, num_stages=4), split),
            ("bf16 g2 weight split noasm", base, rep(split, asm=False)),
            ("bf16 g2 weight wide", base, rep(split, split=False)),
            ("bf16 g4 weight wide", base, rep(split, groups=4, split=False)),
            ("bf16 g1 dot", base, FP4Kernel(groups=1)),
            ("bf16 g2 dot", base, FP4Kernel(groups=2)),
            ("bf16 g2 dot noasm", base, FP4Kernel(groups=2, asm=False)),
            ("fp8 g2 a32", base, FP4Kernel(dot="fp8", groups=2)),
            ("fp8 g4 a128", base, FP4Kernel(dot="fp8", groups=4, act_group=128)),
            ("fp8 g2 a32 n64/128", wide, FP4Kernel(dot="fp8", groups=2)),
        ]
    else:                                                     # prefill: 128-row blocks
        n128 = rep(base, block_n1=128, block_n2=128)
        n256 = rep(base, block_n1=128, block_n2=256)
        out = [
            ("bits g2 weight split", base, rep(split, decode="bf16")),
            ("bits g2 weight32 split", base, rep(split, scale="weight32", decode="bf16")),
            ("e4m3 g2 weight32 split", base, rep(split, scale="weight32")),
            ("bits g2 weight split n128/128", n128, rep(split, decode="bf16")),
            ("bf16 g2 weight split n128/128", n128, split),
            ("bf16 g2 weight split n128/256", n256, split),
            ("bf16 g4 weight split", base, rep(split, groups=4)),
            ("bf16 g2 weight split n128/128 s4", rep(n128, num_stages=4), split),
            ("bf16 g2 weight wide", base, rep(split, split=False)),
            ("bf16 g2 weight wide n128/128", n128, rep(split, split=False)),
            ("bf16 g2 weight", base, FP4Kernel(groups=2, scale="weight")),
            ("bf16 g1 dot", base, FP4Kernel(groups=1)),
            ("fp8 g1 a32", base, FP4Kernel(dot="fp8", groups=1)),
            ("fp8 g2 a32", base, FP4Kernel(dot="fp8", groups=2)),
        ]
    match = [m.strip() for m in os.environ.get("PROBE_MATCH", "").split(",") if m.strip()]
    out = [v for v in out + [dequant] if not match or any(m in v[0] for m in match)]
    return [default] + out


def main() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = {fmt: experts(fmt, gen) for fmt in ("ue8m0", "float32")}
    say(f"# E={E} K={K} H={H} I={I} device={torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu (interpreter)'}")
    best: dict[int, tuple[float, str]] = {}
    skipped: list[str] = []
    for t in TS:
        # bf16 on CUDA; fp16 in the interpreter (whose bf16 tiles multiply wrongly, tests/kernels/conftest.py)
        x = torch.randn(t, H, device=DEV, generator=gen).to(torch.bfloat16 if DEV == "cuda" else torch.float16)
        ids = torch.rand(t, E, device=DEV, generator=gen).topk(K, dim=1).indices
        topk_weights = torch.softmax(torch.randn(t, K, device=DEV, generator=gen), dim=1)
        refs: dict[tuple[str, str, int], torch.Tensor] = {}

        def ref(fmt: str, kern: FP4Kernel) -> torch.Tensor:
            key = (fmt, kern.dot if kern.path == "group" else "bf16", kern.act_group)
            if key not in refs:
                w = weights[fmt]
                if key[1] == "fp8":
                    refs[key] = reference.fp4_moe_experts_fp8(x, *w, topk_weights, ids, LIMIT, kern.act_group,
                                                              fmt == "ue8m0")
                else:
                    refs[key] = reference.fp4_moe_experts(x, *w, topk_weights, ids, LIMIT)
            return refs[key]

        rows = [(name, cfg, kern, "ue8m0") for name, cfg, kern in variants(t)]
        # float32 scales: the e4m3 decode (the bf16 one takes UE8M0 scales only).
        rows += [(f"{name} [f32 scales]", cfg, dataclasses.replace(kern, decode="e4m3"), "float32")
                 for name, cfg, kern in variants(t)[:2]]
        for name, cfg, kern, fmt in rows:
            label = f"T={t:5d} {name}"
            if time.time() - START > BUDGET_S:
                skipped.append(label)
                continue
            w = weights[fmt]
            try:
                def run() -> torch.Tensor:
                    return fp4_moe(x, *w, topk_weights, ids, LIMIT, config=cfg, kernel=kern)
                out = run()
                r = ref(fmt, kern)
                err = ((out.float() - r.float()).abs().max() / r.float().abs().max()).item()
                us = time_us(run)
            except Exception as exc:                        # report and go on: one bad variant is a result
                say(f"{label:44s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                continue
            nbytes = moved_bytes(t, ids, w)
            say(f"{label:44s} {us:10.1f} us  {nbytes / 1e6:9.2f} MB  {nbytes / us / 1e3:7.1f} GB/s  "
                f"max err {err:.2e}  [{cfg.block_m}x{cfg.block_n1}/{cfg.block_n2} w{cfg.num_warps} s{cfg.num_stages}]")
            if fmt == "ue8m0" and err < 0.05 and (t not in best or us < best[t][0]):
                best[t] = (us, name)
    if skipped:
        say(f"# skipped after {BUDGET_S} s: {', '.join(skipped)}")
    for t, (us, name) in best.items():
        say(f"BEST T={t}: {name} ({us:.1f} us)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp4_moe_variants.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
