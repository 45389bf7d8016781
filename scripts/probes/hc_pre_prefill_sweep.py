"""hc_pre launch configs at prefill sizes (bf16 streams [T, 4, 4096], fn float32 [24, 16384]):
today's tf32x3 config against the bf16 split of fn (``HCConfig.bf16_split``: fn's tile split into
three bf16 parts in registers every K step).

For T in 512, 4096, 8192 each config is checked against ``reference.hc_pre`` (x: rtol 1.6e-2
atol 1e-2; post, comb: rtol 1e-4 atol 1e-5, as tests/kernels' GPU test) and timed as CUDA-graph
replays of 20 calls (``gpu_kernel_check.graph_us``). The time is the whole hc_pre (projection
kernel + the collapse launch); the collapse launch alone is timed too, and "proj" is the
difference. GB/s counts the stream bytes read once, against the copy rate measured here
(read + write bytes of a 1 GiB copy / time); "floor" is the stream bytes at that rate.
Each config runs in try/except (a failure prints its error and the sweep goes on); the sweep
stops starting new configs after ~150 s. Ends with the best checked config per T.

Run from the repository root on the GPU machine (other token counts as arguments):
    python scripts/probes/hc_pre_prefill_sweep.py [T ...]
"""
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, "scripts")
from gpu_kernel_check import graph_us  # noqa: E402

from deepinfer.kernels import hyper_connection as hc  # noqa: E402
from deepinfer.kernels import pdl  # noqa: E402
from deepinfer.kernels import reference  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
N, D, ITERS = 4, 4096, 20
BUDGET_S = 150.0
START = time.time()

# (block_t, block_k, num_splits, num_warps, num_stages), all with bf16_split=True
SWEEP = [(128, 64, 8, 8, 3), (128, 64, 16, 8, 3), (128, 128, 8, 8, 3), (128, 64, None, 8, 3),
         (128, 64, None, 8, 4), (128, 64, 16, 4, 4), (64, 64, 16, 4, 3), (64, 128, 16, 4, 3),
         (64, 64, None, 4, 3), (256, 64, 8, 8, 3), (16, 64, 32, 4, 3), (32, 64, 16, 4, 3)]


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def old_default(t: int) -> hc.HCConfig:
    """The tf32x3 config pick_config chose before the bf16 split (float32 tile, tf32x3 dots)."""
    return hc.HCConfig(64, 64, None, 8, 0) if t <= 1024 else hc.HCConfig(128, 64, 8, 8, 0)


def collapse_us(s: torch.Tensor, pre: torch.Tensor) -> float:
    """The second launch of hc_pre alone (as _mix launches it)."""
    t = s.shape[0]
    s2 = s.view(t, N * D)
    x = torch.empty(t, D, dtype=s.dtype, device=DEV)
    return graph_us(lambda: hc._hc_collapse_kernel[(t, triton.cdiv(D, 1024))](
        s2, pre, pre, x, D, s2.stride(0), x.stride(0), 0.0, N=N, BLOCK_D=1024, NORM=False, num_warps=4,
        **pdl.flags(s2.device)))


def random_inputs(t: int, gen: torch.Generator) -> tuple:
    """hc_pre's positional arguments at V4-Flash widths: bf16 streams [T, n, D] and a
    connection's fn / base / scale with mixes of order 1."""
    s = torch.randn(t, N, D, device=DEV, generator=gen).to(BF16)                 # [T, n, D]
    m = (2 + N) * N
    fn = torch.randn(m, N * D, device=DEV, generator=gen) / 64                    # mixes O(1) at K = n*D
    base = torch.randn(m, device=DEV, generator=gen)
    scale = torch.rand(3, device=DEV, generator=gen) + 0.5
    return (s, fn, base, scale, ITERS, 1e-6, 1e-6)


def sweep_t(t: int, rate: float) -> tuple[float, str] | None:
    gen = torch.Generator(device=DEV).manual_seed(t)
    args = random_inputs(t, gen)
    s = args[0]
    rx, rpost, rcomb = reference.hc_pre(*args)
    stream_bytes = s.numel() * 2
    floor = stream_bytes / rate / 1e3
    pre = torch.rand(t, N, device=DEV)
    col = collapse_us(s, pre)
    print(f"\nT={t}: streams {stream_bytes / 1e6:.0f} MB, floor {floor:.1f} us at {rate:.0f} GB/s; "
          f"collapse launch alone {col:.1f} us")
    new_default = hc.pick_config(t, s.device, s.dtype)
    configs = [("old default", old_default(t)), ("new default", new_default)]
    configs += [("", hc.HCConfig(bt, bk, ns, nw, 0, True, st)) for bt, bk, ns, nw, st in SWEEP]
    best = None
    for tag, cfg in configs:
        if time.time() - START > BUDGET_S:
            print(f"  {tag:11s} {cfg}: skipped (time budget spent)")
            continue
        try:
            x, post, comb = hc.hc_pre(*args, config=cfg)
            errs = [(x.float() - rx.float()).abs().max().item(), (post - rpost).abs().max().item(),
                    (comb - rcomb).abs().max().item()]
            ok = (torch.allclose(x.float(), rx.float(), rtol=1.6e-2, atol=1e-2)
                  and torch.allclose(post, rpost, rtol=1e-4, atol=1e-5)
                  and torch.allclose(comb, rcomb, rtol=1e-4, atol=1e-5))
            us = graph_us(lambda: hc.hc_pre(*args, config=cfg))
        except Exception as exc:                                                  # noqa: BLE001
            print(f"  {tag:11s} {cfg}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        proj = us - col
        print(f"  {tag:11s} {cfg}: {us:7.1f} us (proj {proj:6.1f} us = {proj / floor:4.2f}x floor)  "
              f"{stream_bytes / us / 1e3:5.0f} GB/s whole, {stream_bytes / max(proj, 1e-3) / 1e3:5.0f} GB/s proj"
              f"  err x {errs[0]:.1e} post {errs[1]:.1e} comb {errs[2]:.1e}  {'ok' if ok else 'FAIL'}")
        if ok and (best is None or us < best[0]):
            best = (us, f"{cfg} ({tag or 'sweep'})")
    return best


def main() -> None:
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rate = copy_gbps()
    print(f"copy rate (read + write of 1 GiB): {rate:.0f} GB/s")
    bests = {}
    for t in [int(a) for a in sys.argv[1:]] or (512, 4096, 8192):
        try:
            bests[t] = sweep_t(t, rate)
        except Exception as exc:                                                  # noqa: BLE001
            print(f"T={t}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        torch.cuda.empty_cache()
    print("\nbest checked config per T (whole hc_pre, graph replays):")
    for t, best in bests.items():
        print(f"  T={t}: " + (f"{best[0]:.1f} us {best[1]}" if best else "none passed"))
    print(f"done in {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
