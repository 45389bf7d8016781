"""hc_post fused with the next connection's projection (``hc_post_project``, partials) and
hc_pre from those partials (one finish + collapse launch, with the block's norm), against
the unfused pair (hc_post, then hc_pre with norm: projection launch + collapse launch), at
prefill sizes: bf16 streams [T, 4, 4096], fn float32 [24, 16384], V4's float32 norm weight.

Checks first, on the device: max abs difference of the new streams (expected 0: the same
elementwise math), x, post and comb between the pairs (the projection sums the same
products in another order: post/comb differ by float32 ulps, x by about one bf16 ulp).
Then times, with ``triton.testing.do_bench`` (median, in one process): both pairs, each
launch alone (hc_post, hc_pre, hc_post_project, hc_pre from partials, and the plain
collapse+norm launch, so the per-token finishing work folded into it shows), and a sweep of
hc_post_project configs (block_t, block_d, num_splits, num_warps, num_stages), each checked
against the default config's streams and partials-derived outputs; the sweep stops starting
configs after ~BUDGET_S seconds and ends with the best. One pass over the streams at the
measured copy rate (read + write of 1 GiB) is the floor to compare with: the unfused pair
reads the streams 3 times and writes them once, the fused pair reads them twice.

Run from the repository root on the GPU machine (other token counts as arguments):
    python scripts/probes/hc_post_fuse.py [T ...]
"""
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, "scripts/probes")
from hc_pre_prefill_sweep import random_inputs  # noqa: E402

from deepinfer.kernels import hyper_connection as hc  # noqa: E402
from deepinfer.kernels import pdl  # noqa: E402
from deepinfer.kernels.rms_norm import row_config  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
N, D, EPS = 4, 4096, 1e-6
BUDGET_S = 150.0

# (block_t, block_d, num_splits, num_warps, num_stages)
SWEEP = [(64, 64, None, 8, 3), (64, 64, 8, 8, 3), (64, 64, 16, 8, 3), (64, 64, 4, 8, 3), (64, 32, None, 4, 3),
         (64, 32, 8, 4, 3), (64, 128, None, 8, 3), (64, 128, 8, 8, 2), (32, 64, None, 4, 3), (32, 64, 8, 4, 3),
         (32, 128, None, 8, 3), (32, 32, 16, 4, 3), (16, 64, None, 4, 3), (16, 128, 4, 4, 3),
         (128, 32, None, 8, 3), (128, 64, 8, 8, 2), (128, 64, None, 8, 3), (64, 64, None, 4, 4),
         (64, 64, 32, 8, 3), (32, 64, 16, 4, 2)]


def bench_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def agree(got: tuple, want: tuple) -> bool:
    """Streams equal; x within the GPU test's bf16 tolerance; post/comb within float32 sums."""
    return (torch.equal(got[0], want[0])
            and torch.allclose(got[1].float(), want[1].float(), rtol=1.6e-2, atol=1e-2)
            and all(torch.allclose(p, q, rtol=1e-4, atol=1e-5) for p, q in zip(got[2:], want[2:])))


def run_t(t: int, rate: float) -> None:
    gen = torch.Generator(device=DEV).manual_seed(t)
    s, fn0, base0, scale0, iters, hc_eps, norm_eps = random_inputs(t, gen)          # this connection
    _, fn, base, scale, *_ = random_inputs(t, gen)                                   # the next one
    _, post, comb = hc.hc_pre(s, fn0, base0, scale0, iters, hc_eps, norm_eps)        # real mixings
    block_out = torch.randn(t, D, device=DEV, generator=gen).to(BF16)              # [T, D]
    w = torch.randn(D, device=DEV, generator=gen) + 1                               # [D] float32
    nxt = (fn, base, scale, iters, hc_eps, norm_eps)

    def unfused():
        new = hc.hc_post(block_out, s, post, comb)
        return (new,) + hc.hc_pre(new, *nxt, norm=(w, EPS))

    def fused(cfg=None):
        new, part = hc.hc_post_project(block_out, s, post, comb, fn, config=cfg)
        return (new,) + hc.hc_pre(new, *nxt, norm=(w, EPS), partials=part)

    a, b = unfused(), fused()
    one_pass = s.numel() * 2 / rate / 1e3
    print(f"\nT={t}: streams {s.numel() * 2 / 1e6:.0f} MB, one pass {one_pass:.1f} us "
          f"(floor: unfused ~{4 * one_pass:.0f} us, fused ~{3 * one_pass:.0f} us); "
          f"default {hc.pick_post_config(t, s.device, BF16)}")
    print("  max abs diff fused vs unfused: " + ", ".join(
        f"{name} {max_diff(p, q):.3g}" for name, p, q in zip(("streams", "x", "post", "comb"), a, b))
        + f"; within tolerance: {agree(b, a)}")

    # Each launch alone.
    new, part = hc.hc_post_project(block_out, s, post, comb, fn)
    s2, x = new.view(t, N * D), torch.empty(t, D, dtype=BF16, device=DEV)
    pre = torch.rand(t, N, device=DEV)
    block_d, warps = row_config(D)

    def collapse_norm():
        hc._hc_collapse_kernel[(t, 1)](
            s2, pre, w, x, D, s2.stride(0), x.stride(0), EPS, N=N, NP=N, BLOCK_D=block_d, NORM=True,
            num_warps=warps, **pdl.flags(s2.device))

    for name, f in (("unfused pair (hc_post + hc_pre norm)", unfused),
                    ("fused pair (hc_post_project + hc_pre partials)", fused),
                    ("  hc_post", lambda: hc.hc_post(block_out, s, post, comb)),
                    ("  hc_pre(norm=) (projection + collapse)", lambda: hc.hc_pre(new, *nxt, norm=(w, EPS))),
                    ("  hc_post_project", lambda: hc.hc_post_project(block_out, s, post, comb, fn)),
                    ("  hc_pre(norm=, partials=) (finish + collapse)",
                     lambda: hc.hc_pre(new, *nxt, norm=(w, EPS), partials=part)),
                    ("  collapse+norm launch alone (no finish)", collapse_norm)):
        print(f"  {name:48s} {bench_us(f):7.1f} us")

    print("  hc_post_project configs (block_t, block_d, splits, warps, stages): us, max diff vs default")
    best = None
    for bt, bd, splits, warps, stages in SWEEP:
        if time.time() - START > BUDGET_S:
            print("  (budget spent: remaining configs skipped)")
            break
        cfg = hc.PostConfig(bt, bd, splits, warps, stages)
        try:
            got = fused(cfg)
            diff, ok = max(max_diff(p, q) for p, q in zip(got, b)), agree(got, b)
            us = bench_us(lambda: hc.hc_post_project(block_out, s, post, comb, fn, config=cfg))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or run is reported
            print(f"  {cfg[:]}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        print(f"  {cfg[:]}: {us:7.1f} us, diff {diff:.3g}{'' if ok else '  MISMATCH'}")
        if ok and (best is None or us < best[0]):
            best = (us, cfg)
    if best:
        print(f"  best: {best[1]} {best[0]:.1f} us")


START = time.time()


def main() -> None:
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rate = copy_gbps()
    print(f"copy rate (read + write of 1 GiB): {rate:.0f} GB/s")
    for t in [int(a) for a in sys.argv[1:]] or (4096,):
        run_t(t, rate)


if __name__ == "__main__":
    main()
