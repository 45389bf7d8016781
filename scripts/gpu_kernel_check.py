"""Check each Triton kernel against its reference at real shapes, and time both.

A development tool for the GPU machine (CUDA, triton): for RMSNorm, RoPE, the
KV-cache store, paged attention (decode and chunked prefill), DeepSeek-V4 sparse
attention, the lightning indexer, DeepSeek-V3 MLA decode, the DeepSeek-V4
hyper-connection mixing (pre / post / head), the DeepSeek-V4 fused norm +
interleaved rope (against the torch op chains it replaces), the sampling filters,
greedy sampling (argmax + logprob, also timed as a CUDA-graph replay), the indexer's top-k
slot selection (against torch.topk + gather + where, also as CUDA-graph replays), the MoE
router's float32 logits, MoE routing and the fused MoE at Llama/DeepSeek-like sizes it prints
the largest error against
``kernels/reference.py``, the median
time of kernel and reference (``triton.testing.do_bench``) and the kernel's
achieved bandwidth: bytes that must move (read once, written once) / time, also
as a fraction of the H200's measured ~4.3 TB/s copy bandwidth. Prefill also
reports TFLOP/s (causal QK^T and PV only). For sparse attention and the indexer
the bytes are those *gathered* (every key row a token reads, plus q and the
output), so where tokens share keys (prefill) L2 hits can lift the figure past
HBM bandwidth; the DeepSeek-V4 compressor counts the states its completing rows gather. These three also sweep their tile configs, to pick the launchers'
defaults from. The fused MoE (DeepSeek-V4-Flash widths:
E=256, K=6, H=4096, I=2048, bf16) reports, per token count, the bytes of the experts
actually touched / time (decode is bound by streaming them), TFLOP/s of the useful
expert FLOPs (prefill is compute bound), eager and CUDA-graph times, and a sweep of
tile configs beside the one :func:`fused_moe.pick_config` chooses. The router logits
(E=256, H=4096, bf16 x) are timed against ``F.linear(x.float(), W)``, eagerly and as
CUDA-graph replays, with a sweep of launch configs beside :func:`router.pick_config`'s.
DeepSeek-V4.1's packed KV records (``kv_records``): the record store against
``reference.store_record`` (bytes equal) and timed beside ``store_kv`` of the bf16 rows; sparse
attention over MXFP8 window records + NVFP4 entry records and the indexer over MXFP4 key records,
each checked against the reference on the records' values and timed beside the same kernel on
bf16 caches of those values (bytes gathered at the record sizes).
Exit status 1 if any check fails.

Run:  python scripts/gpu_kernel_check.py [SECTION ...]   (all: a few minutes on an H200;
      sections: rms_norm rope store_kv paged_decode paged_prefill sparse_attention indexer
      mla_decode router moe_routing fused_moe hyper_connection v4_rope sampling greedy compressor
      topk kv_records)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from deepinfer.kernels import deepseek_v4_rope as v4_rope
from deepinfer.kernels import hyper_connection as hc
from deepinfer.kernels import reference
from deepinfer.kernels.compressor import compress_entries_
from deepinfer.kernels.indexer import IndexerConfig, indexer_scores
from deepinfer.kernels.mla_decode import MLADecodeConfig, mla_decode
from deepinfer.kernels.fused_moe import MoEConfig, fused_moe, pick_config
from deepinfer.kernels.greedy import greedy_sample
from deepinfer.kernels.moe_routing import grouped_topk_sigmoid, topk_route
from deepinfer.kernels.paged_attention import paged_attention, paged_decode_attention
from deepinfer.kernels.rms_norm import rms_norm
from deepinfer.kernels.router import RouterConfig, router_logits
from deepinfer.kernels.router import pick_config as router_config
from deepinfer.kernels.rope import apply_rope_qk_
from deepinfer.kernels.sparse_attention import SparseAttentionConfig, sparse_attention
from deepinfer.kernels.sampling import sampling_filters_
from deepinfer.kernels.kv_records import store_records
from deepinfer.kernels.store_kv import store_kv
from deepinfer.kernels.topk import topk_slots
from deepinfer.kv_spec import record_bytes
from deepinfer.layers.deepseek_v4_common import yarn_inv_freq

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


def captured(fn: Callable[[], object], reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` calls of ``fn``, after one warm-up call on a side stream
    (compiles the kernels, allocates what a first call allocates)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


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
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = reference.paged_decode_attention(q, cache, table, lens, scale, window, sinks)
    check(name, paged_decode_attention(q, cache, table, lens_t, ctx, scale, window, sinks), ref,
          2e-2, 1e-2)
    bench(name + " auto splits",
          lambda: paged_decode_attention(q, cache, table, lens_t, ctx, scale, window, sinks),
          lambda: reference.paged_decode_attention(q, cache, table, lens, scale, window, sinks),
          kv_bytes)
    for splits in (1, 2, 4, 8, 16):
        bench(f"{name} splits={splits}",
              lambda s=splits: paged_decode_attention(q, cache, table, lens_t, ctx, scale, window,
                                                      sinks, num_splits=s), None, kv_bytes)


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


def bench_config(name: str, kernel: Callable[[], object], bytes_moved: int, flops: float) -> None:
    """:func:`bench` for a tile config that may not fit the device (reported, not failed)."""
    try:
        bench(name, kernel, None, bytes_moved, flops)
    except triton.runtime.errors.OutOfResources as e:
        print(f"  time  {name}: does not fit ({e})")


def v4_caches(num_blocks: int, bs: int, dims: list[int], layers: int = 3) -> list[torch.Tensor]:
    """One middle layer's caches [NB, bs, 1, 1, D] of each head dim in ``dims``: views into pages
    shared by ``layers`` layers, like ModelRunner.allocate_kv_cache makes them."""
    sizes = [bs * dim for dim in dims]
    buffer = torch.randn(num_blocks, layers * sum(sizes), device=DEV, dtype=BF16)
    off = sum(sizes)
    views = []
    for n, dim in zip(sizes, dims):
        views.append(buffer[:, off:off + n].view(num_blocks, bs, 1, 1, dim))
        off += n
    return views


def v4_slots(positions: torch.Tensor, seq_of: torch.Tensor, window: int, ratio: int, topk: int,
             bs: int, blocks_per_seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(window slots [T, window], top-k entry slots [T, topk], all visible entry slots [T, N]) of
    queries at ``positions`` of sequences ``seq_of``; sequence b owns a shuffled run of
    ``blocks_per_seq`` blocks per cache. The top-k entries are random visible ones."""
    t = positions.shape[0]
    tables = torch.randperm(int(seq_of.max() + 1) * blocks_per_seq, device=DEV).view(-1, blocks_per_seq)
    table = tables[seq_of]                                                       # [T, blocks]
    pos = positions[:, None] - torch.arange(window - 1, -1, -1, device=DEV)[None, :]
    p = pos.clamp(min=0)
    win = torch.where(pos >= 0, table.gather(1, p // bs) * bs + p % bs, -1)
    entries = (positions + 1) // ratio                                           # [T]
    width = int(entries.max())
    e = torch.arange(width, device=DEV)[None, :].expand(t, -1)
    visible = e < entries[:, None]
    all_entries = torch.where(visible, table.gather(1, e // bs) * bs + e % bs, -1)
    score = torch.rand(t, width, device=DEV).masked_fill(~visible, -1)
    picked = score.topk(min(topk, width), dim=1).indices
    top = torch.where(picked < entries[:, None], all_entries.gather(1, picked), -1)
    return win.int(), top.int(), all_entries.int()


SPARSE_CONFIGS = [(16, 32, 4), (32, 32, 4), (32, 64, 8), (64, 32, 8), (64, 64, 8)]



def v4_prefill_attention_case(t: int = 4096, bs: int = 16) -> dict:
    """One 4096-token prompt's DeepSeek-V4 prefill attention inputs at V4-Flash widths (64
    heads x 512, window 128, ratio-4 entries, top-512): the window and top-k slots with their
    caches, q, sinks, the rope's positions and inv_freq, and the softmax scale."""
    positions = torch.arange(t, device=DEV)
    blocks = -(-t // bs)
    win, top, _ = v4_slots(positions, torch.zeros(t, dtype=torch.long, device=DEV), 128, 4, 512, bs, blocks)
    wc, ec = v4_caches(blocks, bs, [512, 512])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=DEV) / 64))
    return dict(positions=positions, win=win, top=top, wc=wc, ec=ec,
                q=torch.randn(t, 64, 512, device=DEV, dtype=BF16), sinks=torch.randn(64, device=DEV),
                inv_freq=inv_freq, scale=512 ** -0.5)


def sparse_attention_case(t: int, decode: bool, context: int = 8192, h: int = 64, d: int = 512,
                          bs: int = 16) -> None:
    """V4-Flash CSA layer: window 128 + top-512 of the ratio-4 entries. Decode: t sequences of
    ``context`` tokens, one query each; prefill: one sequence's first t tokens."""
    if decode:
        positions = torch.full((t,), context - 1, device=DEV)
        seq_of = torch.arange(t, device=DEV)
    else:
        positions = torch.arange(t, device=DEV)
        seq_of = torch.zeros(t, dtype=torch.long, device=DEV)
    span = int(positions.max()) + 1
    blocks_per_seq = -(-span // bs)
    win, top, _ = v4_slots(positions, seq_of, 128, 4, 512, bs, blocks_per_seq)
    window_cache, entry_cache = v4_caches(int(seq_of.max() + 1) * blocks_per_seq, bs, [d, d])
    sources = [(window_cache, win), (entry_cache, top)]
    q = torch.randn(t, h, d, device=DEV, dtype=BF16)
    sinks = torch.randn(h, device=DEV)
    scale = d ** -0.5
    k = win.shape[1] + top.shape[1]
    gathered = t * k * d * 2 + 2 * q.numel() * 2
    flops = 4 * t * h * k * d
    name = f"{'decode' if decode else 'prefill'} T={t} K=128+512"
    check(name, sparse_attention(q, sources, sinks, scale),
          reference.sparse_attention(q, sources, sinks, scale), 2e-2, 1e-2)
    bench(name + " default", lambda: sparse_attention(q, sources, sinks, scale),
          lambda: reference.sparse_attention(q, sources, sinks, scale), gathered, flops)
    for block_h, block_n, warps in SPARSE_CONFIGS:
        for splits in ((1, 2, 4, 8, 16) if decode else (1,)):
            config = SparseAttentionConfig(block_h, block_n, splits, warps, num_stages=2)
            bench_config(f"{name} H{block_h} N{block_n} w{warps} splits={splits}",
                         lambda c=config: sparse_attention(q, sources, sinks, scale, c), gathered, flops)


def indexer_case(t: int, n: int, decode: bool, hi: int = 64, di: int = 128, bs: int = 16) -> None:
    """V4-Flash indexer over every visible ratio-4 entry: decode, t sequences of 4n tokens;
    prefill, one sequence's first t tokens (N = t / 4 slots a row; position p sees (p + 1) // 4
    of them, the rest are -1)."""
    if decode:
        positions = torch.full((t,), 4 * n - 1, device=DEV)
        seq_of = torch.arange(t, device=DEV)
    else:
        positions = torch.arange(t, device=DEV)
        seq_of = torch.zeros(t, dtype=torch.long, device=DEV)
    blocks_per_seq = -(-(int(positions.max()) + 1) // bs)
    _, _, slots = v4_slots(positions, seq_of, 128, 4, 512, bs, blocks_per_seq)
    (key_cache,) = v4_caches(int(seq_of.max() + 1) * blocks_per_seq, bs, [di])
    q = torch.randn(t, hi, di, device=DEV, dtype=BF16)
    w = torch.randn(t, hi, device=DEV)
    scale = di ** -0.5
    gathered = t * n * di * 2 + q.numel() * 2 + w.numel() * 4 + t * n * 4
    flops = 2 * t * n * hi * di
    name = f"{'decode' if decode else 'prefill'} T={t} N={n}"
    out = indexer_scores(q, w, key_cache, slots, scale)
    ref = reference.indexer_scores(q, w, key_cache, slots, scale)
    none = ref.isneginf()                                                        # the -1 slots
    if not torch.equal(out.isneginf(), none):
        failures.append(name + " (-inf pattern)")
        print(f"  check {name}: FAIL (-inf where the reference is finite, or the reverse)")
    check(name, out.masked_fill(none, 0.0), ref.masked_fill(none, 0.0), 1e-3, 1e-3)
    bench(name + " default", lambda: indexer_scores(q, w, key_cache, slots, scale),
          lambda: reference.indexer_scores(q, w, key_cache, slots, scale), gathered, flops)
    for block_n, warps in ((32, 4), (64, 4), (128, 8)):
        for splits in ((4, 16, 64, 128) if decode else (1,)):
            config = IndexerConfig(block_n, splits, warps, num_stages=3)
            bench_config(f"{name} N{block_n} w{warps} splits={splits}",
                         lambda c=config: indexer_scores(q, w, key_cache, slots, scale, c),
                         gathered, flops)


def mla_decode_case(batch: int, ctx: int, nh: int = 128, r: int = 512, dr: int = 64, bs: int = 64) -> None:
    """DeepSeek-V3 absorbed MLA decode: ``batch`` sequences of ``ctx`` tokens over a latent
    cache view [NB, bs, 1, 1, R + Dr] into pages shared by 3 layers."""
    need = -(-ctx // bs)
    nb = batch * need + 1
    width = r + dr
    buffer = torch.randn(nb, 3 * bs * width, device=DEV, dtype=BF16)
    cache = buffer[:, bs * width:2 * bs * width].view(nb, bs, 1, 1, width)
    table = (torch.randperm(nb - 1, device=DEV) + 1).int()[:batch * need].view(batch, need)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, nh, width, device=DEV, dtype=BF16)
    scale = 192 ** -0.5
    moved = batch * ctx * width * 2 + q.numel() * 2 + batch * nh * r * 2
    flops = 2 * batch * nh * ctx * (width + r)
    name = f"B={batch} ctx={ctx}"
    check(name, mla_decode(q, cache, table, seq_lens, scale, r, ctx),
          reference.mla_decode(q, cache, table, seq_lens, scale, r, ctx), 2e-2, 1e-2)
    bench(name + " default", lambda: mla_decode(q, cache, table, seq_lens, scale, r, ctx),
          lambda: reference.mla_decode(q, cache, table, seq_lens, scale, r, ctx), moved, flops)
    for block_h, block_n, warps in ((16, 32, 4), (32, 32, 4), (64, 32, 8)):
        for splits in (1, 4, 16, 64):
            config = MLADecodeConfig(block_h, block_n, splits, warps, num_stages=2)
            bench_config(f"{name} H{block_h} N{block_n} w{warps} splits={splits}",
                         lambda c=config: mla_decode(q, cache, table, seq_lens, scale, r, ctx, c),
                         moved, flops)
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
    MoEConfig(128, 128, 64, 256, 64, 16, num_warps=8, num_stages=3),
    MoEConfig(128, 128, 64, 128, 64, 8, num_warps=8, num_stages=3),
    MoEConfig(128, 128, 64, 256, 64, 8, num_warps=8, num_stages=2),
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
    bench(name + " graph", captured(run).replay, None, bytes_moved, flops)
    for cfg in sweep:
        bench(f"T={t} {cfg}", lambda c=cfg: run(c), None, bytes_moved, flops)
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


def greedy_case(rows: int, vocab: int, pad: int = 128) -> None:
    """Float32 logits with padding columns (huge, must be ignored): tokens must equal the
    reference's, logprobs within float32 rounding. Times the kernel eagerly, as a CUDA-graph
    replay (its two launches without the Python launch overhead) and at other tile widths;
    bandwidth counts one read of the real vocabulary."""
    x = torch.randn(rows, vocab + pad, device=DEV) * 3
    x[:, vocab:] = 1e4
    tokens, logprobs = greedy_sample(x, vocab)
    ref_tokens, ref_logprobs = reference.greedy_sample(x, vocab)
    name = f"rows={rows} V={vocab}"
    same = bool(torch.equal(tokens, ref_tokens))
    if not same:
        failures.append(name + " tokens")
    print(f"  check {name} tokens: {'ok' if same else 'FAIL (differ from the reference)'}")
    check(name + " logprobs", logprobs, ref_logprobs, 1e-5, 2e-5)
    bytes_moved = rows * vocab * 4
    bench(name + " eager", lambda: greedy_sample(x, vocab), lambda: reference.greedy_sample(x, vocab),
          bytes_moved)
    bench(name + " graph", captured(lambda: greedy_sample(x, vocab)).replay, None, bytes_moved)
    for block in (1024, 4096, 8192):
        bench(f"{name} block={block}", lambda b=block: greedy_sample(x, vocab, block=b), None, bytes_moved)


def v4_rope_case(t: int, h: int = 64, d: int = 512, rot: int = 64, bs: int = 16) -> None:
    """V4-Flash attention at T tokens: q norm + rope [T, 64, 512], kv norm + rope + window-cache
    store [T, 512], inverse rope of the output; YaRN compress rope at positions up to 1M."""
    q = torch.randn(t, h, d, device=DEV, dtype=BF16)
    kv = torch.randn(t, d, device=DEV, dtype=BF16)
    weight = torch.randn(d, device=DEV)
    pos = torch.randint(0, 1 << 20, (t,), device=DEV)
    inv_freq, scaling, eps = yarn_inv_freq(rot, 160000.0, 16.0, 65536, 32, 1).to(DEV), 1.277, 1e-6
    nb = t // bs + 2
    cache = torch.randn(nb, bs, 1, 1, d, device=DEV, dtype=BF16)
    slots = torch.randperm(nb * bs, device=DEV)[:t]
    ref_cache = cache.clone()
    check(f"q T={t}", v4_rope.q_norm_rope(q, pos, inv_freq, scaling, eps),
          reference.q_norm_rope(q, pos, inv_freq, scaling, eps), 1.6e-2, 2e-2)
    check(f"kv T={t}", v4_rope.kv_norm_rope(kv, weight, pos, inv_freq, scaling, eps, cache, slots),
          reference.kv_norm_rope(kv, weight, pos, inv_freq, scaling, eps, ref_cache, slots), 1.6e-2, 2e-2)
    check(f"kv cache T={t}", cache, ref_cache, 1.6e-2, 2e-2)
    check(f"inverse T={t}", v4_rope.interleaved_rope_(q.clone(), pos, inv_freq, scaling, True),
          reference.interleaved_rope(q, pos, inv_freq, scaling, True), 1.6e-2, 2e-2)
    row_bytes = q.numel() * 2
    bench(f"q_norm_rope T={t}", lambda: v4_rope.q_norm_rope(q, pos, inv_freq, scaling, eps),
          lambda: reference.q_norm_rope(q, pos, inv_freq, scaling, eps), 2 * row_bytes)
    bench(f"kv_norm_rope + store T={t}",
          lambda: v4_rope.kv_norm_rope(kv, weight, pos, inv_freq, scaling, eps, cache, slots),
          lambda: reference.kv_norm_rope(kv, weight, pos, inv_freq, scaling, eps, ref_cache, slots),
          3 * kv.numel() * 2)
    # Rotating q back and forth keeps its norm: the timing loop stays finite. Bytes: the rope channels.
    bench(f"inverse rope in place T={t}", lambda: v4_rope.interleaved_rope_(q, pos, inv_freq, scaling, True),
          lambda: reference.interleaved_rope(q, pos, inv_freq, scaling, True), 2 * t * h * rot * 2)


def _rms_norm() -> None:
    print("RMSNorm (bf16, eps 1e-6)")
    rms_norm_case(8192, 4096)
    rms_norm_case(64, 7168)


def _rope() -> None:
    print("RoPE q and k in place (bf16)")
    rope_case(8192, 32, 8, 128)
    rope_case(64, 32, 8, 128)


def _store_kv() -> None:
    print("KV-cache store (bf16, bs 16, Hkv 8, D 128, a layer view into 3-layer pages)")
    store_kv_case(8192, 16, 8, 128)
    store_kv_case(64, 16, 8, 128)
    torch.cuda.empty_cache()


def _paged_decode() -> None:
    print("Paged decode attention (bf16, Hq 32, Hkv 8, D 128, bs 16)")
    decode_case(64, 4096, None, False)
    torch.cuda.empty_cache()
    decode_case(64, 8192, 1024, True)
    torch.cuda.empty_cache()
    decode_case(4, 32768, None, False)
    torch.cuda.empty_cache()


def _paged_prefill() -> None:
    print("Paged prefill attention, chunked and causal (bf16, Hq 32, Hkv 8, D 128, bs 16)")
    prefill_case([2048] * 4, [2048] * 4, None)
    prefill_case([512] * 4, [8192] * 4, None)
    prefill_case([2048] * 4, [4096] * 4, 1024)
    torch.cuda.empty_cache()


def _sparse_attention() -> None:
    print("DeepSeek-V4 sparse attention (bf16, H 64, D 512, bs 16; bytes gathered, 4*T*H*K*D flops)")
    for t in (1, 16, 64):
        sparse_attention_case(t, decode=True)
    sparse_attention_case(4096, decode=False)
    torch.cuda.empty_cache()


def _indexer() -> None:
    print("Lightning indexer scores (bf16, Hi 64, Di 128, bs 16; bytes gathered, 2*T*N*Hi*Di flops)")
    indexer_case(1, 16384, decode=True)
    indexer_case(64, 16384, decode=True)
    indexer_case(4096, 1024, decode=False)
    torch.cuda.empty_cache()


def v41_record_caches(num_blocks: int, bs: int, specs: list[tuple[int, str]],
                      layers: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One middle layer's record caches [NB, bs, 1, 1, record_bytes(fmt, D)] of each (D, fmt) in
    ``specs``, views into byte pages shared by ``layers`` layers, holding the records of random
    rows; and bf16 caches [NB, bs, 1, 1, D] of the same values."""
    rows = [record_bytes(fmt, d) for d, fmt in specs]
    sizes = [bs * r for r in rows]
    buffer = torch.randint(0, 256, (num_blocks, layers * sum(sizes)), dtype=torch.uint8, device=DEV)
    off = sum(sizes)
    records, values = [], []
    for (d, fmt), n, r in zip(specs, sizes, rows):
        view = buffer[:, off:off + n].view(num_blocks, bs, 1, 1, r)
        for lo in range(0, num_blocks, 4096):               # bounded temporaries of the reference
            x = torch.randn(min(4096, num_blocks - lo), bs, 1, 1, d, device=DEV) * 2
            view[lo:lo + x.shape[0]] = reference.pack_record(x, fmt)
        records.append(view)
        values.append(reference.unpack_record(view, fmt, d, BF16))
        off += n
    return records, values


def record_store_case(t: int, d: int, fmt: str, bs: int = 16) -> None:
    num_blocks = -(-t // bs) + 1
    (cache,), _ = v41_record_caches(num_blocks, bs, [(d, fmt)])
    expected = cache.clone()
    x = torch.randn(t, d, device=DEV, dtype=BF16) * 3
    slots = torch.randperm(num_blocks * bs, device=DEV)[:t]
    slots[::7] = -1
    store_records(cache, slots, x, fmt)
    reference.store_record(expected, slots, x, fmt)
    name = f"{fmt} T={t} D={d}"
    ok = torch.equal(cache, expected)
    if not ok:
        failures.append(name)
    print(f"  check {name}: bytes equal to reference.store_record: {ok}")
    bench(name + " store_records", lambda: store_records(cache, slots, x, fmt),
          lambda: reference.store_record(expected, slots, x, fmt), t * (d * 2 + record_bytes(fmt, d)))
    plain = torch.zeros(num_blocks, bs, 1, 1, d, device=DEV, dtype=BF16)
    bench(name + " store_kv of the bf16 rows", lambda: store_kv(plain, slots, x[:, None]), None, t * d * 4)


def record_attention_case(t: int, decode: bool, context: int = 8192, h: int = 64, d: int = 512,
                          bs: int = 16) -> None:
    """A V4.1 ratio-2 layer: window 128 MXFP8 records + top-512 NVFP4 entry records. Decode: t
    sequences of ``context`` tokens; prefill: one sequence's first t tokens."""
    if decode:
        positions = torch.full((t,), context - 1, device=DEV)
        seq_of = torch.arange(t, device=DEV)
    else:
        positions = torch.arange(t, device=DEV)
        seq_of = torch.zeros(t, dtype=torch.long, device=DEV)
    blocks_per_seq = -(-(int(positions.max()) + 1) // bs)
    win, top, _ = v4_slots(positions, seq_of, 128, 2, 512, bs, blocks_per_seq)
    records, values = v41_record_caches(int(seq_of.max() + 1) * blocks_per_seq, bs, [(d, "mxfp8"), (d, "nvfp4")])
    formats = ["mxfp8", "nvfp4"]
    packed = [(records[0], win), (records[1], top)]
    plain = [(values[0], win), (values[1], top)]
    q = torch.randn(t, h, d, device=DEV, dtype=BF16)
    sinks = torch.randn(h, device=DEV)
    scale = d ** -0.5
    rows = win.shape[1] * record_bytes("mxfp8", d) + top.shape[1] * record_bytes("nvfp4", d)
    gathered = t * rows + 2 * q.numel() * 2
    flops = 4 * t * h * (win.shape[1] + top.shape[1]) * d
    name = f"{'decode' if decode else 'prefill'} T={t} K=128+512 records"
    check(name, sparse_attention(q, packed, sinks, scale, formats=formats),
          reference.sparse_attention(q, plain, sinks, scale), 2e-2, 1e-2)
    bench(name + " packed", lambda: sparse_attention(q, packed, sinks, scale, formats=formats), None, gathered, flops)
    bench(name + " bf16 caches", lambda: sparse_attention(q, plain, sinks, scale), None, gathered, flops)


def record_indexer_case(t: int, n: int, decode: bool, hi: int = 64, di: int = 128, bs: int = 16) -> None:
    """The V4.1 indexer over every visible ratio-2 MXFP4 key record (as :func:`indexer_case`)."""
    if decode:
        positions = torch.full((t,), 2 * n - 1, device=DEV)
        seq_of = torch.arange(t, device=DEV)
    else:
        positions = torch.arange(t, device=DEV)
        seq_of = torch.zeros(t, dtype=torch.long, device=DEV)
    blocks_per_seq = -(-(int(positions.max()) + 1) // bs)
    _, _, slots = v4_slots(positions, seq_of, 128, 2, 512, bs, blocks_per_seq)
    (records,), (values,) = v41_record_caches(int(seq_of.max() + 1) * blocks_per_seq, bs, [(di, "mxfp4")])
    q = torch.randn(t, hi, di, device=DEV, dtype=BF16)
    w = torch.randn(t, hi, device=DEV)
    scale = di ** -0.5
    groups = None if decode else seq_of.int()
    gathered = t * slots.shape[1] * record_bytes("mxfp4", di) + q.numel() * 2 + w.numel() * 4 + t * n * 4
    flops = 2 * t * slots.shape[1] * hi * di
    name = f"{'decode' if decode else 'prefill'} T={t} N={slots.shape[1]} key records"
    out = indexer_scores(q, w, records, slots, scale, groups=groups, key_format="mxfp4")
    ref = reference.indexer_scores(q, w, values, slots, scale)
    none = ref.isneginf()
    check(name, out.masked_fill(none, 0.0), ref.masked_fill(none, 0.0), 1e-3, 1e-3)
    bench(name + " packed", lambda: indexer_scores(q, w, records, slots, scale, groups=groups, key_format="mxfp4"),
          None, gathered, flops)
    bench(name + " bf16 keys", lambda: indexer_scores(q, w, values, slots, scale, groups=groups), None, gathered,
          flops)


def _kv_records() -> None:
    print("DeepSeek-V4.1 packed KV records (MXFP8 window 528 B, NVFP4 entries 288 B, MXFP4 keys 68 B; "
          "bytes at the record sizes)")
    for fmt, d in (("mxfp8", 512), ("nvfp4", 512), ("mxfp4", 128)):
        record_store_case(8192, d, fmt)
        record_store_case(64, d, fmt)
    for t in (1, 16, 64):
        record_attention_case(t, decode=True)
    record_attention_case(4096, decode=False)
    record_indexer_case(1, 8192, decode=True)
    record_indexer_case(64, 8192, decode=True)
    record_indexer_case(4096, 2048, decode=False)
    torch.cuda.empty_cache()


def _mla_decode() -> None:
    print("DeepSeek-V3 MLA decode, absorbed (bf16, Nh 128, R 512, Dr 64, bs 64; 2*B*Nh*L*(R+Dr+R) flops)")
    mla_decode_case(1, 32768)
    mla_decode_case(16, 4096)
    mla_decode_case(64, 4096)


def _moe_routing() -> None:
    print("MoE routing (float32 logits, E=256)")
    routing_case(64)
    routing_case(4096)


def _fused_moe() -> None:
    print("Fused MoE, DeepSeek-V4-Flash widths (E=256, K=6, H=4096, I=2048, bf16, swiglu_limit 10)")
    gate_up = torch.randn(256, 4096, 4096, device=DEV, dtype=BF16) / 64
    down = torch.randn(256, 4096, 2048, device=DEV, dtype=BF16) / 45
    for t in (1, 16, 64):
        moe_case(t, gate_up, down, MOE_SWEEP_DECODE)
    moe_case(4096, gate_up, down, MOE_SWEEP_PREFILL)


def compressor_case(name: str, ratio: int, overlap: bool, d: int, b: int, seq_len: int, decode: bool) -> None:
    """DeepSeek-V4 compressor pooling over b sequences of seq_len tokens (bs 64, bf16 states). Decode:
    one row per sequence, 1 in ratio of them completing a window; prefill: the completing rows only,
    as the layer passes them. Bytes: the gathered states of the completing rows, their entries, the rows."""
    c, bs = (2 if overlap else 1) * d, 64
    span = (2 if overlap else 1) * ratio
    nbs, nbe = -(-seq_len // bs), -(-(seq_len // ratio) // bs)
    state = torch.randn(b * nbs + 1, bs, 2, 1, c, device=DEV, dtype=BF16)
    entries = torch.full((b * nbe + 1, bs, 1, 1, d), float("nan"), device=DEV, dtype=BF16)
    state_table = (torch.randperm(b * nbs, device=DEV) + 1).view(b, nbs).int()
    entry_table = (torch.randperm(b * nbe, device=DEV) + 1).view(b, nbe).int()
    if decode:
        seq = torch.arange(b, device=DEV, dtype=torch.int32)
        pos = seq_len - 1 - torch.arange(b, device=DEV) % ratio                   # row b completes if b % r == 0
        done = -(-b // ratio)
    else:
        per_seq = seq_len // ratio
        seq = torch.arange(b, device=DEV, dtype=torch.int32).repeat_interleave(per_seq)
        pos = torch.arange(ratio - 1, seq_len, ratio, device=DEV).repeat(b)
        done = b * per_seq
    bias = torch.randn(ratio, c, device=DEV)
    norm_w = torch.rand(d, device=DEV) + 0.5
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=DEV, dtype=torch.float32) / 64))
    rest = (seq, pos, bias, norm_w, 1e-6, inv_freq, 1.25, ratio, overlap)
    out, ref = entries.clone(), entries.clone()
    compress_entries_(state, state_table, out, entry_table, *rest)
    reference.compress_entries_(state, state_table, ref, entry_table, *rest)
    written = ~ref.isnan()
    if not torch.equal(written, ~out.isnan()):
        failures.append(f"compressor {name}: written entries differ")
        print(f"  check compressor {name}: FAIL (the kernel wrote other entries than the reference)")
    check(f"compressor {name}", out[written], ref[written], 4e-2, 4e-2)
    moved = done * (span * 2 * c + d) * 2 + seq.numel() * 12
    bench(f"compressor {name}", lambda: compress_entries_(state, state_table, out, entry_table, *rest),
          lambda: reference.compress_entries_(state, state_table, ref, entry_table, *rest), moved)


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device time per call (us) of ``fn`` replayed ``reps`` times in one CUDA graph (no host work)."""
    return do_bench(captured(fn, reps).replay, warmup=10, rep=100, return_mode="median") * 1e3 / reps


def hc_sweep(t: int, configs: list[hc.HCConfig], n: int = 4, d: int = 4096) -> None:
    """hc_pre launch configs at T tokens, each checked and timed as CUDA-graph replays."""
    s = torch.randn(t, n, d, device=DEV, dtype=BF16)
    m = (2 + n) * n
    fn = torch.randn(m, n * d, device=DEV) / 64
    base, scale = torch.randn(m, device=DEV), torch.rand(3, device=DEV) + 0.5
    args = (s, fn, base, scale, 20, 1e-6, 1e-6)
    rx, _, rcomb = reference.hc_pre(*args)
    moved = s.numel() * 2 + fn.numel() * 4 + t * d * 2
    default = hc.pick_config(t, s.device, s.dtype)
    for cfg in [default] + configs:
        x, _, comb = hc.hc_pre(*args, config=cfg)
        ok = torch.allclose(x.float(), rx.float(), rtol=1.6e-2, atol=1e-2) and torch.allclose(comb, rcomb,
                                                                                              rtol=1e-4, atol=1e-5)
        if not ok:
            failures.append(f"hc_pre T={t} {cfg}")
        us = graph_us(lambda c=cfg: hc.hc_pre(*args, config=c))
        tag = "default" if cfg is default else "       "
        print(f"  sweep pre T={t:5d} {tag} {cfg}: {us:8.1f} us graph  {moved / us / 1e3:7.0f} GB/s"
              f"{'' if ok else '  FAIL'}")
    one_iter = (s, fn, base, scale, 1, 1e-6, 1e-6)
    print(f"  pre T={t:5d} default, 1 Sinkhorn iteration: {graph_us(lambda: hc.hc_pre(*one_iter)):8.1f} us graph")
    hfn, hbase, hscale = fn[:n].contiguous(), base[:n].contiguous(), scale[:1].contiguous()
    print(f"  head T={t:5d} default: {graph_us(lambda: hc.hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6)):8.1f} us graph")
    post_out = torch.randn(t, d, device=DEV, dtype=BF16)
    _, rpost, _ = reference.hc_pre(*args)
    print(f"  post T={t:5d}: {graph_us(lambda: hc.hc_post(post_out, s, rpost, rcomb)):8.1f} us graph")


def router_case(t: int, sweep: list[RouterConfig], e: int = 256, h: int = 4096) -> None:
    """Router logits at T tokens: checked against the reference, timed eagerly and (T <= 64)
    as CUDA-graph replays against ``F.linear(x.float(), W)``, then each config of ``sweep``.
    Bytes: W (float32) and x read once, the logits written once."""
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    w = torch.randn(e, h, device=DEV) / 64
    ref = reference.router_logits(x, w)
    tol = 1e-5 * ref.abs().max().item()
    check(f"T={t}", router_logits(x, w), ref, 1e-5, tol)
    moved, flops = e * h * 4 + t * h * 2 + t * e * 4, 2 * t * e * h
    default = router_config(t, e, h, x.device)
    print(f"  config {default}")
    bench(f"T={t} eager", lambda: router_logits(x, w), lambda: reference.router_logits(x, w), moved, flops)
    small = t <= 64
    if small:
        ours, theirs = graph_us(lambda: router_logits(x, w)), graph_us(lambda: reference.router_logits(x, w))
        print(f"  graph T={t}: triton {ours:7.1f} us | reference {theirs:7.1f} us ({theirs / ours:4.1f}x)")
    for cfg in sweep:
        try:
            out = router_logits(x, w, cfg)
        except triton.runtime.OutOfResources as exc:          # a config too large for the SM
            print(f"  sweep T={t:5d}         {cfg}: skipped ({exc})")
            continue
        ok = torch.allclose(out, ref, rtol=1e-5, atol=tol)
        if not ok:
            failures.append(f"router T={t} {cfg}")
        us = graph_us(lambda c=cfg: router_logits(x, w, c)) if small else \
            do_bench(lambda c=cfg: router_logits(x, w, c), warmup=10, rep=50, return_mode="median") * 1e3
        tag = "default" if cfg == default else "       "
        print(f"  sweep T={t:5d} {tag} {cfg}: {us:8.1f} us{' graph' if small else ''}  "
              f"{moved / us / 1e3:6.0f} GB/s  {flops / us / 1e6:6.1f} TFLOP/s{'' if ok else '  FAIL'}")


def _router() -> None:
    print("MoE router logits, float32 (E=256, H=4096, bf16 x) vs F.linear(x.float(), W)")
    fma = [RouterConfig(False, 1, be, bk, s, nw, st) for be, bk in ((1, 2048), (2, 1024), (2, 2048), (4, 512))
           for s in (1, 2) for nw, st in ((4, 3), (4, 1), (8, 4))]
    router_case(1, fma)
    fma16 = [RouterConfig(False, bt, be, 4096 // (bt * be), s, 4, 3) for bt in (4, 8, 16) for be in (2, 4)
             for s in (1, 2, 4)]
    dot16 = [RouterConfig(True, 16, be, bk, s, 4, 3) for be in (16, 32) for bk in (64, 128) for s in (8, 16)]
    router_case(16, fma16 + dot16)
    dot64 = [RouterConfig(True, bt, be, 64, s, 4, 3) for bt in (32, 64) for be in (32, 64)
             for s in (4, 8, 16)]
    fma64 = [RouterConfig(False, 16, 2, 128, 1, 4, 3), RouterConfig(False, 16, 4, 64, 2, 4, 3)]
    router_case(64, dot64 + fma64)
    router_case(4096, [RouterConfig(True, bt, be, bk, s, nw, st)
                       for bt, be, nw in ((128, 64, 8), (64, 128, 8), (128, 128, 8), (64, 64, 4))
                       for bk, st in ((32, 3), (32, 4), (64, 3)) for s in (1, 2)])


def _hyper_connection() -> None:
    print("Hyper-connections (bf16 streams, n 4, D 4096, 20 Sinkhorn iterations)")
    for t in (1, 64, 4096):
        hc_case(t)
    small = [hc.HCConfig(16, bk, ns, w, one) for one in (0, 16) for bk in (64, 256) for ns in (None, 16, 128)
             for w in (4, 8)]
    fma = [hc.HCConfig(1, bk, ns, w, 1) for bk in (64, 128, 256) for ns in (None, 32, 64, 128) for w in (1, 2, 4)]
    hc_sweep(1, small + fma)
    for t in (4, 16):
        hc_sweep(t, small + [hc.HCConfig(4, bk, ns, w, 0) for bk in (32, 64) for ns in (None, 64) for w in (2, 4)])
    hc_sweep(64, [hc.HCConfig(bt, bk, ns, w, 0) for bt in (16, 32) for bk in (64, 128) for ns in (None, 8, 32)
                  for w in (4, 8)])
    hc_sweep(4096, [hc.HCConfig(bt, bk, ns, 8, 0, split) for split in (False, True) for bt in (64, 128)
                    for bk in (64, 128) for ns in (None, 8, 16)])


def _v4_rope() -> None:
    print("DeepSeek-V4 fused norm + interleaved rope (bf16, H 64, D 512, R 64) vs the torch op chains")
    for t in (1, 64, 4096):
        v4_rope_case(t)


def _sampling() -> None:
    print("Sampling filters (float32 logits) vs the torch sort/topk path")
    for rows in (1, 64, 256):
        for min_p, top_k, top_p in ((0.0, 50, 1.0), (0.0, 129280, 0.9), (0.0, 50, 0.95), (0.05, 129280, 1.0)):
            sampling_case(rows, 129280, min_p, top_k, top_p)
    sampling_case(64, 151936, 0.0, 20, 0.8)


def _greedy() -> None:
    print("Greedy sampling (float32 logits, argmax + logprob) vs the torch argmax/logsumexp path")
    for rows in (1, 16, 64):
        greedy_case(rows, 129280)


def topk_case(t: int, n: int, k: int, prefill: bool) -> None:
    """Indexer top-k over float32 scores: prefill, token p of one sequence sees (p + 1) // 4 of
    the N candidates (the rest -inf); decode, all N. Sets must equal the torch path's row by
    row (distinct scores: no ties). Times both eagerly and as CUDA-graph replays, and the
    kernel at other warp counts; bytes: the scores and slots read, the slots written."""
    scores = (torch.rand(t, n, device=DEV).argsort(dim=1).float() - n / 2) * 0.37 + 0.01
    if prefill:
        visible = torch.arange(n, device=DEV)[None, :] < (torch.arange(t, device=DEV)[:, None] + 1) // 4
        scores = scores.masked_fill(~visible, float("-inf"))
    slots = torch.randperm(4 * n, device=DEV)[:n].int().expand(t, -1).contiguous()
    name = f"{'prefill' if prefill else 'decode'} T={t} N={n} k={k}"
    out = topk_slots(scores, slots, k)
    ref = reference.topk_slots(scores, slots, k)
    same = torch.equal(out.sort(dim=1).values, ref.sort(dim=1).values)
    if not same:
        failures.append(f"topk {name}")
    print(f"  check {name}: {'ok' if same else 'FAIL (sets differ from torch.topk)'}")
    moved = t * n * 8 + t * k * 4

    def kernel() -> torch.Tensor:
        return topk_slots(scores, slots, k)

    def torch_path() -> torch.Tensor:
        return reference.topk_slots(scores, slots, k)

    bench(name + " eager", kernel, torch_path, moved)
    kernel_us, torch_us = graph_us(kernel), graph_us(torch_path)
    print(f"  graph {name}: triton {kernel_us:8.1f} us | torch {torch_us:8.1f} us "
          f"({torch_us / kernel_us:5.1f}x)")
    for warps in (1, 2, 4, 8, 16):
        if n // (32 * warps) <= 64:                                              # at most 64 scores a thread
            us = graph_us(lambda w=warps: topk_slots(scores, slots, k, w))
            print(f"  graph {name} w{warps}: {us:8.1f} us")


def _topk() -> None:
    print("Indexer top-k slot selection (float32 scores, int32 slots) vs torch.topk + gather + where")
    topk_case(4096, 1024, 512, prefill=True)
    topk_case(1, 4096, 512, prefill=False)
    topk_case(16, 4096, 512, prefill=False)
    topk_case(16, 16384, 512, prefill=False)
    torch.cuda.empty_cache()


def _compressor() -> None:
    print("DeepSeek-V4 compressor pooling (bf16 states, V4-Flash widths, R 64)")
    for label, ratio, overlap, d in (("HCA r128 D512", 128, False, 512), ("CSA r4 D512", 4, True, 512),
                                     ("indexer r4 D128", 4, True, 128)):
        compressor_case(f"{label} decode B64 L4096", ratio, overlap, d, 64, 4096, decode=True)
        compressor_case(f"{label} prefill B1 L8192", ratio, overlap, d, 1, 8192, decode=False)


SECTIONS: dict[str, Callable[[], None]] = {
    "rms_norm": _rms_norm,
    "rope": _rope,
    "store_kv": _store_kv,
    "paged_decode": _paged_decode,
    "paged_prefill": _paged_prefill,
    "sparse_attention": _sparse_attention,
    "indexer": _indexer,
    "mla_decode": _mla_decode,
    "router": _router,
    "moe_routing": _moe_routing,
    "fused_moe": _fused_moe,
    "hyper_connection": _hyper_connection,
    "v4_rope": _v4_rope,
    "sampling": _sampling,
    "greedy": _greedy,
    "compressor": _compressor,
    "topk": _topk,
    "kv_records": _kv_records,
}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernel_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        print(f"gpu_kernel_check: unknown section(s) {unknown}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for name in chosen:
        SECTIONS[name]()
    print("FAILED: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
