"""Each FP8 GEMM of a DeepSeek-V4-Flash decode step, timed where the model calls it.

Wraps ``fp8_gemm._gemm`` so every call (eager decode, ``--enforce-eager``) is timed alone with CUDA
events and recorded with its shape, launch config and operand layout, then runs ``bench decode``
in-process. Prints one line per distinct call (mean us over the timed steps), slowest first, and
the same shape re-timed in isolation on fresh operands, so a call slow only in the model stands out.

    python scripts/probes/fp8_gemm_in_model.py --batch-size 1 [bench decode args...]
"""
import collections
import sys

import torch

from deepinfer.kernels import fp8_gemm

calls: dict[tuple, list[float]] = collections.defaultdict(list)
_orig = fp8_gemm._gemm


def _timed(a, a_scale, w, ws, block, group, pow2_scale, out_dtype, invariant, split, tiles):
    if not a.is_cuda or torch.cuda.is_current_stream_capturing():
        return _orig(a, a_scale, w, ws, block, group, pow2_scale, out_dtype, invariant, split, tiles)
    m, k = a.shape
    key = (m, w.shape[0], k, a.dtype, ws.dtype, a_scale is None, tuple(a.stride()), a.data_ptr() % 16,
           tuple(w.stride()), tuple(ws.shape), group, block, pow2_scale, out_dtype)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = _orig(a, a_scale, w, ws, block, group, pow2_scale, out_dtype, invariant, split, tiles)
    end.record()
    end.synchronize()
    calls[key].append(start.elapsed_time(end) * 1e3)
    return out


fp8_gemm._gemm = _timed


def main() -> None:
    from deepinfer.entrypoints import cli
    args = ["bench", "decode", "--config", "deepseek-v4-flash", "--num-layers", "4", "--weights", "fp8+fp4",
            "--context-len", "1024", "--steps", "8", "--warmup", "1", "--no-hf", "--enforce-eager",
            "--no-compare-sync", *sys.argv[1:]]
    cli.main(args)
    fp8_gemm._gemm = _orig
    rows = sorted(calls.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))
    print(f"{'M':>5} {'N':>6} {'K':>6} {'fused':>5} {'wscale':>7} {'a strides':>14} {'a%16':>4} "
          f"{'calls':>5} {'mean us':>8} {'alone us':>8}")
    for key, times in rows:
        m, n, k, adt, wsdt, fused, astr, amod, wstr, wsshape, group, block, pow2, odt = key
        a = torch.randn(m, k, device="cuda", dtype=adt if fused else torch.bfloat16)
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        ws = (torch.randint(120, 130, wsshape, device="cuda", dtype=torch.uint8) if wsdt == torch.uint8
              else torch.rand(wsshape, device="cuda") + 0.5)
        if fused:
            fn = lambda: fp8_gemm.fp8_linear(a, w, ws, block, group, pow2)
        else:
            xq, xs = fp8_gemm.fp8_act_quant(a, group, pow2)
            fn = lambda: fp8_gemm.fp8_block_gemm(xq, xs, w, ws, block, odt)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        e.synchronize()
        alone = s.elapsed_time(e) * 1e3 / 20
        print(f"{m:5d} {n:6d} {k:6d} {str(fused):>5} {str(wsdt).split('.')[-1]:>7} {str(astr):>14} {amod:4d} "
              f"{len(times):5d} {sum(times) / len(times):8.1f} {alone:8.1f}   group={group} block={block} "
              f"wstrides={wstr} out={odt}")


if __name__ == "__main__":
    main()
