"""The hyper-connection pre (``hc_pre``, n 4, D 4,096, bf16 streams: DeepSeek-V4-Flash) under
batch-invariant candidate configs against the normal mode's ``pick_config(T)``, at T = 1, 16, 64
and 4,096: µs per call (median of CUDA-event timed calls after warm-up, launch included: at small
T that is the launch, not the kernel) and whether token 0's
outputs are bitwise the same at every T (a config is usable in the mode only if they are).
Candidates: the mode's current config (``invariant_config``), and fixed token blocks of 16 to
128 over 16 or 32 K splits, each with bf16 streams against fn's three bf16 parts or tf32x3.

    python scripts/probes/hc_invariant_configs.py            # on a GPU, ~1 minute
    python scripts/probes/hc_invariant_configs.py --dry-run  # CPU, Triton interpreter, tiny D
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--dry-run", action="store_true", help="Triton interpreter on the CPU, D 64, T up to 32")
OPTS = ARGS.parse_args()
if OPTS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from deepinfer.kernels import hyper_connection as hc  # noqa: E402

DEV = torch.device("cpu" if OPTS.dry_run else "cuda")
N, D = 4, (64 if OPTS.dry_run else 4096)
SIZES = (1, 16, 32) if OPTS.dry_run else (1, 16, 64, 4096)
ITERS = 2 if OPTS.dry_run else 30


def main() -> None:
    g = torch.Generator().manual_seed(0)
    ncol = (2 + N) * N
    fn = (torch.randn(ncol, N * D, generator=g) * 0.02).to(DEV)
    base = (torch.randn(ncol, generator=g) * 0.1).to(DEV)
    scale = torch.rand(3, generator=g).to(DEV) + 0.5
    streams_max = torch.randn(max(SIZES), N, D, generator=g).to(DEV, torch.bfloat16)
    candidates = {"current": hc.invariant_config(torch.bfloat16)}
    for block_t in (16, 32, 64, 128):
        for splits in (16, 32):
            for split in (True, False):
                cfg = hc.HCConfig(block_t, 64, splits, 4 if block_t <= 32 else 8, 0, split)
                if cfg != candidates["current"]:            # timed once, as "current"
                    candidates[f"t{block_t} s{splits} {'bf16x3' if split else 'tf32x3'}"] = cfg

    def run(streams, cfg):
        return hc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, config=cfg)

    def timed(streams, cfg) -> float:
        for _ in range(3):
            run(streams, cfg)
        if DEV.type != "cuda":
            return float("nan")
        times = []
        for _ in range(ITERS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(streams, cfg)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    print(f"{'config':22s} " + " ".join(f"{'T=' + str(t):>10s}" for t in SIZES) + "  token 0 bits at every T")
    normal = [timed(streams_max[:t], hc.pick_config(t, DEV, torch.bfloat16)) for t in SIZES]
    print(f"{'normal (pick_config)':22s} " + " ".join(f"{u:10.1f}" for u in normal))
    for name, cfg in candidates.items():
        us, rows = [], []
        for t in SIZES:
            us.append(timed(streams_max[:t], cfg))
            rows.append([o[0].clone() for o in run(streams_max[:t], cfg)])
        same = all(torch.equal(a, b) for r in rows[1:] for a, b in zip(rows[0], r))
        ratio = " ".join(f"{u:10.1f}" for u in us)
        print(f"{name:22s} {ratio}  {'same' if same else 'DIFFER'}; x normal: "
              + " ".join(f"{u / v:.2f}" for u, v in zip(us, normal)), flush=True)


if __name__ == "__main__":
    main()
