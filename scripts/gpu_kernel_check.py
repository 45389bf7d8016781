"""Check each Triton kernel against its reference at real shapes, and time both.

A development tool for the GPU machine (CUDA, triton): for RMSNorm, RoPE, the
KV-cache store and paged attention (decode and chunked prefill) at Llama/DeepSeek-like
sizes it prints the largest error against ``kernels/reference.py``, the median
time of kernel and reference (``triton.testing.do_bench``) and the kernel's
achieved bandwidth: bytes that must move (read once, written once) / time, also
as a fraction of the H200's measured ~4.3 TB/s copy bandwidth. Prefill also
reports TFLOP/s (causal QK^T and PV only). The fused MoE (DeepSeek-V4-Flash widths:
E=256, K=6, H=4096, I=2048, bf16) reports, per token count, the bytes of the experts
actually touched / time (decode is bound by streaming them), TFLOP/s of the useful
expert FLOPs (prefill is compute bound), eager and CUDA-graph times, and a sweep of
tile configs beside the one :func:`fused_moe.pick_config` chooses. Exit status 1 if
any check fails.

Run:  python scripts/gpu_kernel_check.py        (about a minute on an H200)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from deepinfer.kernels import reference
from deepinfer.kernels.fused_moe import MoEConfig, fused_moe, pick_config
from deepinfer.kernels.moe_routing import grouped_topk_sigmoid, topk_route
from deepinfer.kernels.paged_attention import paged_attention, paged_decode_attention
from deepinfer.kernels.rms_norm import rms_norm
from deepinfer.kernels.rope import apply_rope_qk_
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


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def routing_case(t: int) -> None:
    logits = torch.randn(t, 256, device=DEV) * 2
    bias = torch.randn(256, device=DEV) * 0.1
    for name, kernel, ref in (
        (f"V4 sqrtsoftplus+bias top-6 T={t}", lambda: topk_route(logits, 6, "sqrtsoftplus", 1.5, True, bias),
         lambda: reference.biased_topk(logits, bias, 6, "sqrtsoftplus", 1.5)),
        (f"V3 grouped sigmoid top-8 T={t}", lambda: grouped_topk_sigmoid(logits, bias, 8, 4, 8, True, 2.5),
         lambda: reference.grouped_topk_sigmoid(logits, bias, 8, 4, 8, True, 2.5)),
    ):
        w, ids = by_expert(*kernel())
        ref_w, ref_ids = by_expert(*ref())
        if not torch.equal(ids, ref_ids):
            failures.append(name)
            print(f"  check {name}: FAIL (different experts chosen)")
        check(name, w, ref_w, 1e-5, 1e-6)
        bench(name, kernel, ref, logits.numel() * 4 + ids.numel() * 12)


MOE_SWEEP_DECODE = [
    MoEConfig(16, 32, 128, 64, 128, 1, num_warps=4, num_stages=3),
    MoEConfig(16, 32, 256, 64, 256, 1, num_warps=4, num_stages=3),
    MoEConfig(16, 16, 256, 32, 256, 1, num_warps=4, num_stages=4),
    MoEConfig(16, 64, 128, 128, 128, 1, num_warps=4, num_stages=4),
    MoEConfig(16, 32, 64, 64, 64, 1, num_warps=2, num_stages=6),
]
MOE_SWEEP_PREFILL = [
    MoEConfig(128, 64, 64, 128, 64, 8, num_warps=8, num_stages=3),
    MoEConfig(128, 64, 64, 128, 64, 8, num_warps=4, num_stages=4),
    MoEConfig(128, 128, 64, 256, 64, 8, num_warps=8, num_stages=3),
    MoEConfig(64, 128, 64, 128, 64, 8, num_warps=4, num_stages=3),
    MoEConfig(64, 64, 64, 128, 64, 8, num_warps=4, num_stages=4),
    MoEConfig(128, 64, 128, 128, 128, 8, num_warps=8, num_stages=2),
]


def moe_case(t: int, gate_up: torch.Tensor, down: torch.Tensor, sweep: list[MoEConfig],
             limit: float = 10.0, top_k: int = 6) -> None:
    e, two_i, h = gate_up.shape
    i = two_i // 2
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    weights, ids = topk_route(torch.randn(t, e, device=DEV), top_k, "sqrtsoftplus", 1.5, True,
                              torch.randn(e, device=DEV) * 0.1)
    touched = ids.unique().numel()
    bytes_moved = touched * 3 * h * i * 2 + 2 * x.numel() * 2      # touched experts' weights, x in, out
    flops = 2 * t * top_k * 3 * h * i
    name = f"T={t} ({touched} experts touched, {touched * 3 * h * i * 2 / 1e9:.2f} GB)"

    def run(cfg: MoEConfig | None = None) -> torch.Tensor:
        return fused_moe(x, gate_up, down, weights, ids, limit, config=cfg)

    ref = reference.clamped_moe_experts(x, gate_up, down, weights, ids, limit)
    check(name, run(), ref, 2e-2, 2e-2 * ref.float().abs().max().item())
    print(f"  config {pick_config(t, top_k, e, h, i)}")
    bench(name + " eager", run, lambda: reference.clamped_moe_experts(x, gate_up, down, weights, ids, limit),
          bytes_moved, flops)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    bench(name + " graph", graph.replay, None, bytes_moved, flops)
    for cfg in sweep:
        bench(f"T={t} {cfg}", lambda c=cfg: run(c), None, bytes_moved, flops)


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
    print("MoE routing (float32 logits, E=256)")
    routing_case(64)
    routing_case(4096)
    print("Fused MoE, DeepSeek-V4-Flash widths (E=256, K=6, H=4096, I=2048, bf16, swiglu_limit 10)")
    gate_up = torch.randn(256, 4096, 4096, device=DEV, dtype=BF16) / 64
    down = torch.randn(256, 4096, 2048, device=DEV, dtype=BF16) / 45
    for t in (1, 16, 64):
        moe_case(t, gate_up, down, MOE_SWEEP_DECODE)
    moe_case(4096, gate_up, down, MOE_SWEEP_PREFILL)


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
