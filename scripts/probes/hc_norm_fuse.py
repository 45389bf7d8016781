"""hc_pre with the block's RMSNorm fused into its collapse (``norm=``), against the unfused
pair (hc_pre, then the rms_norm kernel), at prefill sizes: bf16 streams [T, 4, 4096],
fn float32 [24, 16384], V4's float32 norm weight (round_first=False).

Checks first, on the device: the fused block input equals the unfused pair's bit for bit
(the fusion shares rms_norm's tile and reduction), and post/comb are unchanged. Then times,
with ``triton.testing.do_bench`` (median, in one process): the whole call both ways, and the
second launch alone both ways (collapse + norm launches vs the fused collapse), which is
where the saving is: the unfused pair writes x [T, D] and reads it back in another launch.
The copy rate (read + write of 1 GiB) gives the time of one pass over the streams.

Run from the repository root on the GPU machine (other token counts as arguments):
    python scripts/probes/hc_norm_fuse.py [T ...]
"""
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, "scripts/probes")
from hc_pre_prefill_sweep import random_inputs  # noqa: E402

from deepinfer.kernels import hyper_connection as hc  # noqa: E402
from deepinfer.kernels import pdl  # noqa: E402
from deepinfer.kernels.rms_norm import rms_norm, row_config  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
N, D, ITERS, EPS = 4, 4096, 20, 1e-6


def bench_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def run_t(t: int, rate: float) -> None:
    gen = torch.Generator(device=DEV).manual_seed(t)
    args = random_inputs(t, gen)
    s = args[0]
    w = torch.randn(D, device=DEV, generator=gen) + 1                             # [D] float32

    def unfused():
        x, post, comb = hc.hc_pre(*args)
        return rms_norm(x, w, EPS, round_first=False), post, comb

    def fused():
        return hc.hc_pre(*args, norm=(w, EPS))

    a, b = unfused(), fused()
    same = [torch.equal(p, q) for p, q in zip(a, b)]
    print(f"\nT={t}: streams {s.numel() * 2 / 1e6:.0f} MB, one pass {s.numel() * 2 / rate / 1e3:.1f} us; "
          f"bitwise equal x/post/comb: {same}")

    # The second launch(es) alone, as _mix launches them.
    s2 = s.view(t, N * D)
    pre = torch.rand(t, N, device=DEV)
    x = torch.empty(t, D, dtype=BF16, device=DEV)
    y = torch.empty_like(x)
    flags = pdl.flags(s2.device)

    def collapse_then_norm():
        hc._hc_collapse_kernel[(t, triton.cdiv(D, 1024))](
            s2, pre, pre, x, D, s2.stride(0), x.stride(0), 0.0, N=N, BLOCK_D=1024, NORM=False,
            num_warps=4, **flags)
        rms_norm(x, w, EPS, round_first=False)

    block_d, warps = row_config(D)

    def collapse_norm():
        hc._hc_collapse_kernel[(t, 1)](
            s2, pre, w, y, D, s2.stride(0), y.stride(0), EPS, N=N, BLOCK_D=block_d, NORM=True,
            num_warps=warps, **flags)

    for name, f in (("hc_pre + rms_norm (unfused)", unfused), ("hc_pre(norm=) (fused)", fused),
                    ("collapse launch + rms_norm launch", collapse_then_norm),
                    ("collapse+norm launch", collapse_norm)):
        print(f"  {name:36s} {bench_us(f):7.1f} us")


def main() -> None:
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rate = copy_gbps()
    print(f"copy rate (read + write of 1 GiB): {rate:.0f} GB/s")
    for t in [int(a) for a in sys.argv[1:]] or (1, 512, 4096):
        run_t(t, rate)


if __name__ == "__main__":
    main()
