"""FP8 block-scaled GEMM launch variants at DeepSeek-V4-Flash decode shapes (M = 1, 16, 64) and one
prefill shape (M = 4096): ``fp8_act_quant`` then the GEMM, unsplit and split K (S = 2, 4, 8) at the
default tiles, then BLOCK_N / num_warps / num_stages around the best of those; a bf16 ``x @ w.T`` of the same
shape for the bytes comparison. Each line: µs per call as CUDA-event medians of single launches
(``ev``) and as CUDA-graph replays (``graph``, no launch gaps), the weight bytes, GB/s from the
graph time, and the largest absolute difference from the float32 reference (``BAD`` past 1% of
the output's largest value). The last lines name the best correct configuration per shape (graph
time). Compiled kernels stay in Triton's cache, so a second run on the same machine reaches further
within its budget.

    python scripts/probes/fp8_gemm_variants.py                   # on a GPU, about 3 minutes
    python scripts/probes/fp8_gemm_variants.py --budget 100      # stop starting variants after 100 s
    python scripts/probes/fp8_gemm_variants.py --dry-run         # CPU, tiny shapes, Triton interpreter
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--dry-run", action="store_true", help="tiny shapes in the Triton interpreter on the CPU")
ARGS.add_argument("--budget", type=float, default=140.0, help="seconds after which no new variant starts")
ARGS.add_argument("--reps", type=int, default=50, help="timed launches per variant")
OPTS = ARGS.parse_args()
if OPTS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"                   # read when the kernels are first decorated
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from deepinfer.kernels import fp8_gemm, reference  # noqa: E402
from deepinfer.kernels.launch import sm_count  # noqa: E402
from deepinfer.models.quant import dequant_fp8_block, quant_fp8_block  # noqa: E402
from scripts.gpu_kernel_check import captured  # noqa: E402

DEV = "cpu" if OPTS.dry_run else "cuda"
START = time.perf_counter()
BEST: dict[str, tuple[float, str]] = {}
SKIPPED = 0

if OPTS.dry_run:
    DECODE_M, PREFILL_M = (1, 16), 40
    SHAPES = [("kv", 64, 512), ("q_b", 256, 256)]
    REPS = 2
else:
    DECODE_M, PREFILL_M = (1, 16, 64), 4096
    SHAPES = [("q_a", 1024, 4096), ("kv", 512, 4096), ("q_b", 32768, 1024), ("o_b", 4096, 8192),
              ("gate_up", 4096, 4096), ("down", 4096, 2048)]
    REPS = OPTS.reps
FORMATS = {"f32": ((128, 128), "float32"), "e8m0": ((32, 32), "ue8m0")}


def event_us(fn) -> float:
    """Median µs of single launches, each between two CUDA events (launch gaps included)."""
    fn()
    if DEV == "cpu":
        times = []
        for _ in range(REPS):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for a, b in pairs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


def graph_us(fn, reps: int = 20) -> float:
    """Median µs per call of ``reps`` calls captured in one CUDA graph (no launch gaps)."""
    if DEV == "cpu":
        return float("nan")
    graph = captured(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(5, REPS // 5)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def measure(case: str, label: str, fn, ref: torch.Tensor | None, weight_bytes: int) -> None:
    global SKIPPED
    if time.perf_counter() - START > OPTS.budget:
        SKIPPED += 1
        return
    try:
        out = fn()
        diff = (out.float() - ref).abs().max().item() if ref is not None else float("nan")
        bad = ref is not None and not diff <= 1e-2 * ref.abs().max().item()     # bf16 rounding is 2^-8
        ev, gr = event_us(fn), graph_us(fn)
    except Exception as exc:                              # a config the compiler refuses: say so, go on
        print(f"{case:28s} {label:44s} FAILED {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        return
    key = gr if gr == gr else ev
    print(f"{case:28s} {label:44s} ev {ev:8.1f} us  graph {gr:8.1f} us  {weight_bytes / 1e6:7.2f} MB "
          f"{weight_bytes / key / 1e3:7.0f} GB/s  maxdiff {diff:.3g}{'  BAD' if bad else ''}", flush=True)
    if not label.startswith("bf16") and not bad and (case not in BEST or key < BEST[case][0]):
        BEST[case] = (key, label)


class Case:
    """One shape's operands, float32 reference and the launches timed on it."""

    def __init__(self, name: str, m: int, n: int, k: int, fmt: str) -> None:
        self.block, scale_format = FORMATS[fmt]
        self.pow2 = scale_format == "ue8m0"
        gen = torch.Generator().manual_seed(n + k)
        wq, ws = quant_fp8_block(torch.randn(n, k, generator=gen) / k ** 0.5, self.block, scale_format)
        self.wq, self.ws = wq.to(DEV), ws.to(DEV)
        self.x = torch.randn(m, k, generator=gen).to(DEV, torch.bfloat16)
        xq, xs = reference.fp8_act_quant(self.x.float(), 128, self.pow2)
        self.ref = reference.fp8_block_gemm(xq, xs, self.wq, self.ws, self.block, torch.float32)
        self.name, self.m, self.n, self.k, self.fmt = f"{name} M={m} N={n} K={k} {fmt}", m, n, k, fmt
        self.wbytes = wq.numel() + ws.numel() * ws.element_size()

    def linear(self, **kw):
        return lambda: fp8_gemm.fp8_linear(self.x, self.wq, self.ws, self.block, 128, self.pow2, **kw)

    def first_pass(self) -> None:
        """Unsplit, each split at the default tiles, the defaults, the bf16 GEMM."""
        measure(self.name, "quant+gemm S=1", self.linear(split=1), self.ref, self.wbytes)
        default = fp8_gemm.pick_tiles(self.m, self.n)
        if self.m <= 64:
            for split in (2, 4, 8):
                if (self.k // 128) % split:
                    continue
                label = f"quant+gemm S={split} tiles={default}"
                measure(self.name, label, self.linear(split=split, tiles=default), self.ref, self.wbytes)
        measure(self.name, "auto (fp8_linear defaults)", self.linear(), self.ref, self.wbytes)
        if self.fmt == "f32":
            wb = dequant_fp8_block(self.wq, self.ws, self.block).to(torch.bfloat16)
            measure(self.name, "bf16 x @ w.T (2 bytes a weight)", lambda: self.x @ wb.t(), None, wb.numel() * 2)

    def tile_sweep(self) -> None:
        """BLOCK_N, num_warps, num_stages around the first pass's best split."""
        if self.name not in BEST or self.m > 64:
            return
        label = BEST[self.name][1]
        split = int(label.split("S=")[1].split()[0]) if "S=" in label else 1
        default = fp8_gemm.pick_tiles(self.m, self.n)
        for bn in (16, 32, 64, 128):
            for warps, stages in ((4, 4), (4, 3), (2, 4), (4, 6), (8, 4)):
                tiles = (default[0], bn, warps, stages)
                if tiles == default or bn > max(16, triton.next_power_of_2(self.n)):
                    continue
                measure(self.name, f"quant+gemm S={split} tiles={tiles}",
                        self.linear(split=split, tiles=tiles), self.ref, self.wbytes)


def main() -> None:
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (interpreter)"
    print(f"# {dev}; SMs {sm_count(torch.device(DEV))}", flush=True)
    cases = [Case(name, m, n, k, "f32") for m in DECODE_M for name, n, k in SHAPES]
    cases += [Case(SHAPES[0][0], m, *SHAPES[0][1:], "e8m0") for m in DECODE_M]
    prefill = SHAPES[-2] if len(SHAPES) > 2 else SHAPES[0]
    cases.append(Case(prefill[0], PREFILL_M, *prefill[1:], "f32"))
    # Every shape's first pass before any tile sweep, so a short budget still covers every shape.
    for case in cases:
        case.first_pass()
    for case in cases:
        case.tile_sweep()
    print(f"# {SKIPPED} variants skipped past the {OPTS.budget:.0f} s budget; "
          f"{time.perf_counter() - START:.0f} s in all", flush=True)
    for name, (us, label) in BEST.items():
        print(f"BEST {name:28s} {us:8.1f} us  {label}")


if __name__ == "__main__":
    main()
