"""Check each Triton kernel against its reference at real shapes, and time both.

A development tool for the GPU machine (CUDA, triton): for RMSNorm, RoPE, the
KV-cache store, paged attention (decode and chunked prefill), the DeepSeek-V4
hyper-connection mixing (pre / post / head) and the sampling filters at
Llama/DeepSeek-like sizes it prints the largest error against ``kernels/reference.py``, the median
time of kernel and reference (``triton.testing.do_bench``) and the kernel's
achieved bandwidth: bytes that must move (read once, written once) / time, also
as a fraction of the H200's measured ~4.3 TB/s copy bandwidth. Prefill also
reports TFLOP/s (causal QK^T and PV only). Exit status 1 if any check fails.

Run:  python scripts/gpu_kernel_check.py        (about two minutes on an H200)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from deepinfer.kernels import hyper_connection as hc
from deepinfer.kernels import reference
from deepinfer.kernels.paged_attention import paged_attention, paged_decode_attention
from deepinfer.kernels.rms_norm import rms_norm
from deepinfer.kernels.rope import apply_rope_qk_
from deepinfer.kernels.sampling import sampling_filters_
from deepinfer.kernels.store_kv import store_kv

H200_COPY_GBPS = 4300.0
DEV = "cuda"
BF16 = torch.bfloat16
failures: list[str] = []


def check(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    err = (out.float() - ref.float()).abs()
    bad = (err > atol + rtol * ref.float().abs()) | out.isnan()
    status = "ok" if not bad.any() else f"FAIL ({int(bad.sum())} elements out of tolerance)"
    if bad.any():
        failures.append(name)
    print(f"  check {name}: max abs err {err.max().item():.3e} "
          f"(ref max {ref.float().abs().max().item():.2f}) {status}")


def bench(name: str, kernel: Callable[[], object], ref: Callable[[], object] | None,
          bytes_moved: int, flops: float | None = None) -> float:
    t_kernel = do_bench(kernel, warmup=25, rep=100, return_mode="median")      # ms
    gbps = bytes_moved / t_kernel / 1e6
    line = (f"  time  {name}: triton {t_kernel * 1e3:9.1f} us  {gbps:7.0f} GB/s "
            f"({gbps / H200_COPY_GBPS:4.0%} of copy)")
    if flops is not None:
        line += f"  {flops / t_kernel / 1e9:6.1f} TFLOP/s"
    if ref is not None:
        t_ref = do_bench(ref, warmup=5, rep=50, return_mode="median")
        line += f" | reference {t_ref * 1e3:10.1f} us ({t_ref / t_kernel:5.1f}x)"
    print(line)
    return t_kernel


def layer_cache(lens: list[int], bs: int, hkv: int, d: int, layers: int = 3):
    """A middle layer's strided view into pages shared by ``layers`` layers, with shuffled blocks."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 1
    n = bs * 2 * hkv * d
    buffer = torch.randn(nb, layers * n, device=DEV, dtype=BF16)
    cache = buffer[:, n:2 * n].view(nb, bs, 2, hkv, d)
    perm = (torch.randperm(nb - 1, device=DEV) + 1).int()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=DEV)
    i = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[i:i + k]
        i += k
    return cache, table


def rms_norm_case(rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device=DEV, dtype=BF16)
    w = torch.randn(cols, device=DEV, dtype=BF16)
    check(f"[{rows}, {cols}]", rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), 1.6e-2, 1e-2)
    bench(f"[{rows}, {cols}]", lambda: rms_norm(x, w, 1e-6), lambda: reference.rms_norm(x, w, 1e-6),
          2 * x.numel() * 2 + cols * 2)


def rope_case(t: int, hq: int, hk: int, d: int) -> None:
    q = torch.randn(t, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(t, hk, d, device=DEV, dtype=BF16)
    angles = torch.rand(t, d // 2, device=DEV) * 1000
    cos, sin = angles.cos(), angles.sin()
    q_ref, k_ref = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
    q2, k2 = q.clone(), k.clone()
    apply_rope_qk_(q2, k2, cos, sin)
    check(f"q T={t}", q2, q_ref, 1.6e-2, 1e-2)
    check(f"k T={t}", k2, k_ref, 1.6e-2, 1e-2)
    # Rotating q2, k2 again and again keeps their norms: the timing loop stays finite.
    bench(f"T={t} Hq={hq} Hk={hk} D={d}", lambda: apply_rope_qk_(q2, k2, cos, sin),
          lambda: (reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)),
          2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 4)


def store_kv_case(t: int, bs: int, hkv: int, d: int) -> None:
    cache, _ = layer_cache([bs * 4096], bs, hkv, d)
    slots = torch.randperm(cache.shape[0] * bs, device=DEV)[:t]
    k = torch.randn(t, hkv, d, device=DEV, dtype=BF16)
    v = torch.randn(t, hkv, d, device=DEV, dtype=BF16)
    expected = cache.clone()
    reference.store_kv(expected, slots, k, v)
    store_kv(cache, slots, k, v)
    check(f"T={t}", cache, expected, 0.0, 0.0)
    bench(f"T={t}", lambda: store_kv(cache, slots, k, v),
          lambda: reference.store_kv(cache, slots, k, v), 2 * 2 * k.numel() * 2 + t * 8)


def decode_case(batch: int, ctx: int, window: int | None, with_sinks: bool,
                hq: int = 32, hkv: int = 8, d: int = 128, bs: int = 16) -> None:
    lens = [ctx] * batch
    cache, table = layer_cache(lens, bs, hkv, d)
    q = torch.randn(batch, hq, d, device=DEV, dtype=BF16) * 2
    sinks = torch.randn(hq, device=DEV) if with_sinks else None
    scale = d ** -0.5
    span = ctx if window is None else min(ctx, window)
    kv_bytes = batch * span * 2 * hkv * d * 2 + 2 * q.numel() * 2
    name = (f"B={batch} ctx={ctx}" + (f" window={window}" if window else "")
            + (" sinks" if with_sinks else ""))
    # The reference gathers every visible key as float32 (2 GiB at B=64, ctx 4096).
    ref = reference.paged_decode_attention(q, cache, table, lens, scale, window, sinks)
    check(name, paged_decode_attention(q, cache, table, lens, scale, window, sinks), ref, 2e-2, 1e-2)
    bench(name + " auto splits",
          lambda: paged_decode_attention(q, cache, table, lens, scale, window, sinks),
          lambda: reference.paged_decode_attention(q, cache, table, lens, scale, window, sinks),
          kv_bytes)
    for splits in (1, 2, 4, 8, 16):
        bench(f"{name} splits={splits}",
              lambda s=splits: paged_decode_attention(q, cache, table, lens, scale, window, sinks,
                                                      num_splits=s), None, kv_bytes)


def prefill_case(q_lens: list[int], lens: list[int], window: int | None,
                 hq: int = 32, hkv: int = 8, d: int = 128, bs: int = 16) -> None:
    cache, table = layer_cache(lens, bs, hkv, d)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, device=DEV, dtype=BF16) * 2
    scale = d ** -0.5
    pairs = 0        # (query, visible key) pairs
    for n, L in zip(q_lens, lens):
        for p in range(L - n, L):
            pairs += p + 1 if window is None else min(p + 1, window)
    flops = 4 * pairs * hq * d
    kv_bytes = sum(lens) * 2 * hkv * d * 2 + 2 * q.numel() * 2
    name = f"q_lens={q_lens[0]}x{len(q_lens)} ctx={lens[0]}" + (f" window={window}" if window else "")
    ref = reference.paged_attention(q, cache, table, starts, lens, scale, window)
    check(name, paged_attention(q, cache, table, starts, lens, scale, window), ref, 2e-2, 1e-2)
    bench(name, lambda: paged_attention(q, cache, table, starts, lens, scale, window),
          lambda: reference.paged_attention(q, cache, table, starts, lens, scale, window),
          kv_bytes, flops)


def hc_case(t: int, n: int = 4, d: int = 4096, iters: int = 20) -> None:
    """V4-Flash widths. pre reads the streams once (bf16) and fn (float32); post reads streams
    and block output and writes the new streams; head is pre with n mixing rows."""
    s = torch.randn(t, n, d, device=DEV, dtype=BF16)
    m = (2 + n) * n
    fn = torch.randn(m, n * d, device=DEV) / 64                     # mixes O(1) at K = n*D
    base, scale = torch.randn(m, device=DEV), torch.rand(3, device=DEV) + 0.5
    args = (s, fn, base, scale, iters, 1e-6, 1e-6)
    x, post, comb = hc.hc_pre(*args)
    rx, rpost, rcomb = reference.hc_pre(*args)
    check(f"pre x T={t}", x, rx, 1.6e-2, 1e-2)
    check(f"pre post T={t}", post, rpost, 1e-4, 1e-5)
    check(f"pre comb T={t}", comb, rcomb, 1e-4, 1e-5)
    stream_bytes = s.numel() * 2
    bench(f"pre T={t} (streams {stream_bytes / 2**20:.2f} MiB + fn {fn.numel() * 4 / 2**20:.2f} MiB)",
          lambda: hc.hc_pre(*args), lambda: reference.hc_pre(*args),
          stream_bytes + fn.numel() * 4 + t * d * 2 + t * (n + n * n) * 4)
    block_out = torch.randn(t, d, device=DEV, dtype=BF16)
    check(f"post T={t}", hc.hc_post(block_out, s, rpost, rcomb),
          reference.hc_post(block_out, s, rpost, rcomb), 1.6e-2, 1e-2)
    bench(f"post T={t}", lambda: hc.hc_post(block_out, s, rpost, rcomb),
          lambda: reference.hc_post(block_out, s, rpost, rcomb), 2 * stream_bytes + t * d * 2)
    hfn, hbase, hscale = fn[:n].contiguous(), base[:n].contiguous(), scale[:1].contiguous()
    check(f"head T={t}", hc.hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6),
          reference.hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6), 1.6e-2, 1e-2)
    bench(f"head T={t}", lambda: hc.hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6),
          lambda: reference.hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6),
          stream_bytes + hfn.numel() * 4 + t * d * 2)


def sampling_case(rows: int, vocab: int, min_p: float, top_k: int, top_p: float) -> None:
    """Temperature-scaled random logits (row max 0). Both paths filter a fresh copy per call;
    bandwidth counts one read and one write of the logits."""
    temps = torch.rand(rows, 1, device=DEV) + 0.5
    x = torch.randn(rows, vocab, device=DEV) * 2.5
    x = (x - x.amax(-1, keepdim=True)) / temps
    mp = torch.full((rows,), min_p, device=DEV)
    tk = torch.full((rows,), top_k, device=DEV, dtype=torch.long)
    tp = torch.full((rows,), top_p, device=DEV)
    out, ref = x.clone(), x.clone()
    sampling_filters_(out, mp, tk, tp)
    reference.sampling_filters_(ref, mp, tk, tp)
    name = f"rows={rows} V={vocab} min_p={min_p} top_k={top_k} top_p={top_p}"
    # Tokens on a rounding boundary may differ (tests/kernels/test_sampling.py checks each one);
    # more than one per row means a bug.
    diff = int(((out > float("-inf")) ^ (ref > float("-inf"))).sum())
    kept = (ref > float("-inf")).sum(-1).float().mean().item()
    status = "ok" if diff <= rows else "FAIL"
    if diff > rows:
        failures.append(name)
    print(f"  check {name}: {diff} tokens kept by one path only (torch keeps {kept:.0f}/row) {status}")
    buf = torch.empty_like(x)
    t_copy = do_bench(lambda: buf.copy_(x), warmup=25, rep=100, return_mode="median")

    def kernel() -> None:
        buf.copy_(x)
        sampling_filters_(buf, mp, tk, tp)

    def torch_path() -> None:
        buf.copy_(x)
        reference.sampling_filters_(buf, mp, tk, tp)

    bench(name + f" (incl. copy {t_copy * 1e3:.1f} us)", kernel, torch_path, 2 * x.numel() * 4)


def run_all() -> None:
    print("RMSNorm (bf16, eps 1e-6)")
    rms_norm_case(8192, 4096)
    rms_norm_case(64, 7168)
    print("RoPE q and k in place (bf16)")
    rope_case(8192, 32, 8, 128)
    rope_case(64, 32, 8, 128)
    print("KV-cache store (bf16, bs 16, Hkv 8, D 128, a layer view into 3-layer pages)")
    store_kv_case(8192, 16, 8, 128)
    store_kv_case(64, 16, 8, 128)
    torch.cuda.empty_cache()
    print("Paged decode attention (bf16, Hq 32, Hkv 8, D 128, bs 16)")
    decode_case(64, 4096, None, False)
    torch.cuda.empty_cache()
    decode_case(64, 8192, 1024, True)
    torch.cuda.empty_cache()
    decode_case(4, 32768, None, False)
    torch.cuda.empty_cache()
    print("Paged prefill attention, chunked and causal (bf16, Hq 32, Hkv 8, D 128, bs 16)")
    prefill_case([2048] * 4, [2048] * 4, None)
    prefill_case([512] * 4, [8192] * 4, None)
    prefill_case([2048] * 4, [4096] * 4, 1024)
    torch.cuda.empty_cache()
    print("Hyper-connections (bf16 streams, n 4, D 4096, 20 Sinkhorn iterations)")
    for t in (1, 64, 4096):
        hc_case(t)
    print("Sampling filters (float32 logits) vs the torch sort/topk path")
    for rows in (1, 64, 256):
        for min_p, top_k, top_p in ((0.0, 50, 1.0), (0.0, 129280, 0.9), (0.0, 50, 0.95), (0.05, 129280, 1.0)):
            sampling_case(rows, 129280, min_p, top_k, top_p)
    sampling_case(64, 151936, 0.0, 20, 0.8)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernel_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    torch.manual_seed(0)
    run_all()
    print("FAILED: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
