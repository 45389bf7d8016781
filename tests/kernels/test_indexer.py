"""Lightning-indexer scores: the Triton kernel (deepinfer/kernels/indexer.py) against
:func:`reference.indexer_scores` on random data, and the reference against a direct sum."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import backend, reference
from deepinfer.kernels import topk as topk_kernel
from deepinfer.kernels.indexer import IndexerConfig, indexer_scores
from tests.kernels.paged_sources import pad_runs, page_buffer_caches, page_buffer_records, random_slots

# float16 stands in for bfloat16 on the CPU: the interpreter cannot multiply bfloat16 tiles.
# Kernel and reference multiply the same rounded inputs in float32, so even low-precision
# inputs agree to float32 summation order.
KERNEL_TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4},
              torch.float16: {"rtol": 1e-3, "atol": 1e-3},
              torch.bfloat16: {"rtol": 1e-3, "atol": 1e-3}}


def make_inputs(t, hi, di, n, bs, nt, dtype, device, gen, num_blocks=10, empty_rows=(1,),
                slot_dtype=torch.int32):
    (cache,) = page_buffer_caches(num_blocks, [(bs, nt, di)], dtype, device, gen)
    slots = random_slots(t, n, num_blocks * bs, gen, 0.25, empty_rows, slot_dtype).to(device)
    q = torch.randn(t, hi, di, generator=gen).to(dtype).to(device)
    weights = torch.randn(t, hi, generator=gen).to(device)
    return q, weights, cache, slots


def test_reference_is_weighted_relu_head_sum():
    gen = torch.Generator().manual_seed(0)
    q, w, cache, slots = make_inputs(3, 4, 8, 7, 4, 1, torch.float32, "cpu", gen)
    scores = reference.indexer_scores(q, w, cache, slots, 0.5)
    for t in range(3):
        for j, s in enumerate(slots[t].tolist()):
            if s < 0:
                assert scores[t, j] == float("-inf")
                continue
            k = cache[s // 4, s % 4, 0, 0]
            expected = sum(w[t, h] * torch.relu(q[t, h] @ k) * 0.5 for h in range(4))
            torch.testing.assert_close(scores[t, j], expected)


CASES = [
    # t, hi, di, n, bs, nt, dtype, config (block_n, splits, warps, stages) or None
    (4, 4, 32, 40, 8, 1, torch.float32, None),
    (5, 6, 48, 37, 4, 2, torch.float32, IndexerConfig(16, 2, 4, 2)),
    (4, 8, 64, 50, 8, 1, torch.float16, IndexerConfig(16, 3, 4, 2)),
    (3, 20, 32, 17, 16, 2, torch.float16, None),
]


@pytest.mark.parametrize("t,hi,di,n,bs,nt,dtype,config", CASES)
def test_triton_indexer_matches_reference(t, hi, di, n, bs, nt, dtype, config, device, poison_empty):
    gen = torch.Generator().manual_seed(n)
    q, w, cache, slots = make_inputs(t, hi, di, n, bs, nt, dtype, device, gen)
    out = indexer_scores(q, w, cache, slots, 0.3, config)
    ref = reference.indexer_scores(q, w, cache, slots, 0.3)
    assert not out.isnan().any()
    assert torch.equal(out.isneginf(), slots < 0)
    assert out[1].isneginf().all()                              # row 1 has no candidate
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("config", [None, IndexerConfig(16, 3, 4, 2)])
def test_triton_indexer_skips_padding_runs(config, device, poison_empty):
    """Trailing -1 runs (which the kernel fills with -inf without gathering) of every length."""
    gen = torch.Generator().manual_seed(10)
    q, w, cache, slots = make_inputs(6, 4, 32, 70, 8, 1, torch.float32, device, gen, empty_rows=())
    slots = pad_runs(slots.cpu(), gen).to(device)
    slots[2, 48:] = -1                                          # a run starting on a tile boundary
    out = indexer_scores(q, w, cache, slots, 0.3, config)
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 0.3),
                               **KERNEL_TOL[torch.float32])


def test_triton_indexer_strided_inputs(device, poison_empty):
    """q with a padded head stride, weights and int64 slots read through column slices."""
    gen = torch.Generator().manual_seed(8)
    t, hi, di = 3, 4, 32
    q, w, cache, slots = make_inputs(t, hi, di, 20, 8, 1, torch.float32, device, gen,
                                     slot_dtype=torch.int64)
    q_wide = torch.randn(t, hi, 2 * di, generator=gen).to(device)
    q_wide[:, :, :di] = q
    w_wide = torch.randn(t, 2 * hi, generator=gen).to(device)
    w_wide[:, hi:] = w
    s_wide = torch.full((t, 25), -1, dtype=torch.int64, device=device)
    s_wide[:, 5:] = slots
    out = indexer_scores(q_wide[:, :, :di], w_wide[:, hi:], cache, s_wide[:, 5:], 0.3,
                         IndexerConfig(16, 1, 4, 2))
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 0.3),
                               **KERNEL_TOL[torch.float32])


def test_triton_indexer_rejects_bad_inputs(device):
    gen = torch.Generator().manual_seed(3)
    q, w, cache, slots = make_inputs(2, 4, 16, 5, 4, 1, torch.float32, device, gen)
    with pytest.raises(ValueError, match="weights must be"):
        indexer_scores(q, w.half(), cache, slots, 1.0)
    with pytest.raises(ValueError, match="key_cache is"):
        indexer_scores(q.half(), w, cache, slots, 1.0)
    with pytest.raises(ValueError, match="slots must be"):
        indexer_scores(q, w, cache, slots.float(), 1.0)


@pytest.mark.parametrize("n,topk,empty_row,cap", [(30, 8, 2, None), (30, 8, 2, 16), (12, 16, 1, None)])
def test_backend_indexer_topk_matches_reference(n, topk, empty_row, cap, monkeypatch, device):
    """Through the kernels: more candidates than topk take the top-k kernel (torch.topk above
    its cap, lowered to ``cap`` here); at most topk candidates are all kept. Either way the set
    equals the reference's, and a row with no visible candidate (all -inf scores) gets -1
    throughout."""
    gen = torch.Generator().manual_seed(n)
    q, w, cache, slots = make_inputs(3, 4, 32, n, 8, 1, torch.float32, device, gen, empty_rows=(empty_row,))
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    if cap is not None:
        monkeypatch.setattr(topk_kernel, "MAX_CANDIDATES", cap)
    picked = backend.indexer_topk(q, w, cache, slots, 0.3, topk)
    expected = reference.indexer_topk(q, w, cache, slots, 0.3, topk)
    assert picked.shape == expected.shape == (3, min(n, topk))
    assert (picked[empty_row] == -1).all() and (picked[0] >= 0).any()
    for row, ref_row in zip(picked.tolist(), expected.tolist()):
        assert sorted(row) == sorted(ref_row)


def sequence_inputs(q_lens, seq_lens, hi, di, ratio, bs, dtype, device, gen, slot_dtype=torch.int64):
    """A batch as the model builds it: sequence b's last ``q_lens[b]`` of ``seq_lens[b]`` tokens
    (a prefix already cached when fewer), each seeing the compressed entries ``0 .. (p+1)//r - 1``
    of its sequence through a shuffled block table ([T, Nmax] slots from reference.paged_slots).
    Returns (q, weights, cache, slots, token_seq)."""
    n_max = -(-max(seq_lens) // ratio)
    per_seq = -(-n_max // bs)
    num_blocks = per_seq * len(seq_lens) + 3
    (cache,) = page_buffer_caches(num_blocks, [(bs, 1, di)], dtype, device, gen)
    table = torch.randperm(num_blocks, generator=gen)[:per_seq * len(seq_lens)].view(len(seq_lens), per_seq)
    seq = torch.cat([torch.full((q,), b, dtype=torch.int32) for b, q in enumerate(q_lens)])
    pos = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    slots = reference.paged_slots(table, bs, seq, pos, n_max, ratio, False).to(slot_dtype)
    t = seq.shape[0]
    q = torch.randn(t, hi, di, generator=gen).to(dtype)
    weights = torch.randn(t, hi, generator=gen)
    return q.to(device), weights.to(device), cache, slots.to(device), seq.to(device)


BLOCK_CASES = [
    # q_lens, seq_lens, hi, di, ratio, dtype, config (block_n, splits, warps, stages, block_t)
    ([45], [45], 4, 32, 1, torch.float32, IndexerConfig(16, 1, 4, 2, block_t=4)),          # partial last block
    ([13, 6, 1, 9, 23], [13, 6, 1, 9, 23], 4, 32, 1, torch.float32,
     IndexerConfig(16, 1, 4, 2, block_t=4)),                                               # blocks straddle
    ([13, 6, 1, 9, 23], [30, 6, 40, 9, 23], 6, 48, 2, torch.float16,
     IndexerConfig(16, 2, 4, 2, block_t=8)),                                               # cached prefixes
    ([3, 1, 1, 2], [50, 7, 33, 64], 4, 32, 2, torch.float32, IndexerConfig(16, 3, 4, 2, block_t=2)),
    ([37, 20], [37, 20], 20, 32, 1, torch.float16, None),                                  # default config
]


@pytest.mark.parametrize("q_lens,seq_lens,hi,di,ratio,dtype,config", BLOCK_CASES)
def test_triton_indexer_token_blocks_match_reference(q_lens, seq_lens, hi, di, ratio, dtype, config,
                                                     device, poison_empty):
    """Token blocks (groups = each token's sequence) against the reference and the per-token
    kernel: one sequence with a partial last block, blocks straddling sequences (one pass per
    sequence), cached prefixes, splits, and tokens that see no entry yet."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    q, w, cache, slots, seq = sequence_inputs(q_lens, seq_lens, hi, di, ratio, 4, dtype, device, gen)
    out = indexer_scores(q, w, cache, slots, 0.3, config, groups=seq)
    assert not out.isnan().any()
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 0.3), **KERNEL_TOL[dtype])
    torch.testing.assert_close(out, indexer_scores(q, w, cache, slots, 0.3), **KERNEL_TOL[dtype])


def test_triton_indexer_token_blocks_any_rows_of_one_id(device, poison_empty):
    """The contract, not the prefix shape: rows of one id that agree wherever both are >= 0 (here
    random holes in one shared row, ids interleaved within blocks) score as the reference."""
    gen = torch.Generator().manual_seed(11)
    t, n, hi, di = 11, 40, 4, 32
    q, w, cache, _ = make_inputs(t, hi, di, n, 8, 1, torch.float32, device, gen)
    ids = torch.tensor([0, 1, 0, 0, 2, 1, 1, 0, 2, 2, 0], dtype=torch.int32)
    rows = random_slots(3, n, 80, gen, 0.0).long()                              # one row per id
    slots = torch.where(torch.rand(t, n, generator=gen) < 0.3, -1, rows[ids.long()])
    slots, ids = slots.to(device), ids.to(device)
    out = indexer_scores(q, w, cache, slots, 0.3, IndexerConfig(16, 1, 4, 2, block_t=4), groups=ids)
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 0.3),
                               **KERNEL_TOL[torch.float32])


def test_triton_indexer_token_blocks_reject_bad_inputs(device):
    gen = torch.Generator().manual_seed(4)
    q, w, cache, slots, seq = sequence_inputs([9], [9], 4, 16, 1, 4, torch.float32, device, gen)
    with pytest.raises(ValueError, match="groups must be"):
        indexer_scores(q, w, cache, slots, 1.0, groups=seq[:-1])
    with pytest.raises(ValueError, match="groups must be"):
        indexer_scores(q, w, cache, slots, 1.0, groups=seq.float())
    with pytest.raises(ValueError, match="needs groups"):
        indexer_scores(q, w, cache, slots, 1.0, IndexerConfig(16, 1, 4, 2, block_t=4))
    with pytest.raises(ValueError, match="block_t must be"):
        IndexerConfig(16, 1, 4, 2, block_t=3)
    with pytest.raises(ValueError, match="exceeds 256 query rows"):     # 32 tokens x 16 head rows
        indexer_scores(q, w, cache, slots, 1.0, IndexerConfig(16, 1, 4, 2, block_t=32), groups=seq)
    with pytest.raises(ValueError, match="block_n must be"):
        IndexerConfig(8, 1, 4, 2)


def test_backend_indexer_topk_token_blocks(monkeypatch, device):
    """backend.indexer_topk with groups (the model's prefill call) keeps what the reference keeps,
    up to ties: the same number of slots a row with the same scores (a score is exactly 0 where
    every head's dot is negative, so ties at 0 are common with few heads)."""
    gen = torch.Generator().manual_seed(12)
    q, w, cache, slots, seq = sequence_inputs([40, 3, 25], [40, 30, 25], 4, 32, 1, 4, torch.float32,
                                              device, gen)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    picked = backend.indexer_topk(q, w, cache, slots, 0.3, 8, seq).cpu()
    expected = reference.indexer_topk(q, w, cache, slots, 0.3, 8).cpu()
    assert picked.shape == expected.shape == (q.shape[0], 8)
    scores, slots = reference.indexer_scores(q, w, cache, slots, 0.3).cpu(), slots.cpu()
    for row in range(q.shape[0]):
        score_of = dict(zip(slots[row].tolist(), scores[row].tolist()))
        kept = [score_of[s] for s in picked[row].tolist() if s >= 0]
        assert len(set(picked[row].tolist()) - {-1}) == len(kept)                 # distinct slots
        assert sorted(kept) == sorted(score_of[s] for s in expected[row].tolist() if s >= 0)


# --- real shapes (DeepSeek-V4-Flash indexer: Hi 64, Di 128) on the GPU ----------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,n,dtype", [(1, 16384, torch.bfloat16), (64, 16384, torch.bfloat16),
                                       (4096, 1024, torch.bfloat16), (64, 4000, torch.float32)])
def test_triton_indexer_gpu_sizes(t, n, dtype, poison_empty):
    gen = torch.Generator().manual_seed(t)
    bs = 16
    q, w, cache, slots = make_inputs(t, 64, 128, n, bs, 1, dtype, torch.device("cuda"), gen,
                                     num_blocks=-(-n // bs) * 2, empty_rows=(0,))
    out = indexer_scores(q, w, cache, slots, 128 ** -0.5)
    ref = reference.indexer_scores(q, w, cache, slots, 128 ** -0.5)
    assert not out.isnan().any()
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_lens,seq_lens", [([4096], [4096]), ([1000, 7, 1, 2500], [1000, 3000, 9, 2500])])
def test_triton_indexer_gpu_token_blocks(q_lens, seq_lens, poison_empty):
    """Token blocks at V4-Flash widths (ratio 4, block size 16): one 4096-token prompt, and a
    batch with cached prefixes and blocks straddling sequences."""
    gen = torch.Generator().manual_seed(len(q_lens))
    q, w, cache, slots, seq = sequence_inputs(q_lens, seq_lens, 64, 128, 4, 16, torch.bfloat16,
                                              torch.device("cuda"), gen)
    out = indexer_scores(q, w, cache, slots, 128 ** -0.5, groups=seq)
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 128 ** -0.5),
                               **KERNEL_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_n,num_warps", [(32, 4), (64, 4), (128, 8)])
def test_triton_indexer_gpu_configs(block_n, num_warps, poison_empty):
    """Every tile config gpu_kernel_check.py times compiles and is exact."""
    gen = torch.Generator().manual_seed(6)
    q, w, cache, slots = make_inputs(16, 64, 128, 3000, 16, 1, torch.bfloat16, torch.device("cuda"),
                                     gen, num_blocks=400)
    out = indexer_scores(q, w, cache, slots, 128 ** -0.5, IndexerConfig(block_n, 4, num_warps, 3))
    torch.testing.assert_close(out, reference.indexer_scores(q, w, cache, slots, 128 ** -0.5),
                               **KERNEL_TOL[torch.bfloat16])


# -- packed keys (DeepSeek-V4.1's MXFP4 index keys) ----------------------------------------------------
def record_keys(num_blocks, bs, nt, di, dtype, device, gen, fmt="mxfp4"):
    """(a record key cache, its keys decoded as float32 values, and as values of ``dtype``)."""
    (cache,), (values,) = page_buffer_records(num_blocks, [(bs, nt, di, fmt)], torch.float32, device, gen)
    return cache, values, values.to(dtype)


PACKED_CASES = [
    # t, hi, di, n, bs, nt, dtype, config
    (4, 4, 32, 40, 8, 1, torch.float32, None),
    (5, 6, 64, 37, 4, 2, torch.float32, IndexerConfig(16, 2, 4, 2)),
    (4, 8, 96, 50, 8, 1, torch.float16, IndexerConfig(16, 3, 4, 2)),            # Di not a power of two
]


@pytest.mark.parametrize("t,hi,di,n,bs,nt,dtype,config", PACKED_CASES)
def test_triton_indexer_reads_packed_keys(t, hi, di, n, bs, nt, dtype, config, device, poison_empty):
    """MXFP4 key records decoded in the kernel score as the kernel on their values, bit for bit,
    close to the reference, which scores the records exactly as their values; the top-k picks
    the same keys."""
    gen = torch.Generator().manual_seed(n + di)
    num_blocks = 10
    cache, values, q_values = record_keys(num_blocks, bs, nt, di, dtype, device, gen)
    slots = random_slots(t, n, num_blocks * bs, gen, 0.25, (1,)).to(device)
    q = torch.randn(t, hi, di, generator=gen).to(dtype).to(device)
    w = torch.randn(t, hi, generator=gen).to(device)
    ref = reference.indexer_scores(q, w, values, slots, 0.3)
    assert torch.equal(reference.indexer_scores(q, w, cache, slots, 0.3, "mxfp4"), ref)
    out = indexer_scores(q, w, cache, slots, 0.3, config, key_format="mxfp4")
    assert torch.equal(out, indexer_scores(q, w, q_values, slots, 0.3, config))
    assert torch.equal(out.isneginf(), slots < 0)
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    for row, ref_row in zip(reference.topk_slots(out, slots, 8).tolist(),
                            reference.topk_slots(ref, slots, 8).tolist()):
        assert sorted(row) == sorted(ref_row)


def test_triton_indexer_token_blocks_read_packed_keys(device, poison_empty):
    """The token-block kernel (prefill: groups = each token's sequence) on MXFP4 key records."""
    gen = torch.Generator().manual_seed(21)
    q, w, plain, slots, seq = sequence_inputs([13, 6, 1, 9], [30, 6, 40, 9], 4, 32, 2, 4, torch.float32,
                                              device, gen)
    cache, values, _ = record_keys(plain.shape[0], 4, 1, 32, torch.float32, device, gen)
    config = IndexerConfig(16, 2, 4, 2, block_t=4)
    out = indexer_scores(q, w, cache, slots, 0.3, config, groups=seq, key_format="mxfp4")
    assert torch.equal(out, indexer_scores(q, w, values, slots, 0.3, config, groups=seq))
    torch.testing.assert_close(out, reference.indexer_scores(q, w, values, slots, 0.3), **KERNEL_TOL[torch.float32])


def test_backend_indexer_scores_pass_the_key_format(monkeypatch, device):
    gen = torch.Generator().manual_seed(22)
    cache, values, _ = record_keys(6, 4, 1, 32, torch.float32, device, gen)
    slots = random_slots(3, 12, 24, gen).to(device)
    q = torch.randn(3, 4, 32, generator=gen).to(device)
    w = torch.randn(3, 4, generator=gen).to(device)
    ref = reference.indexer_scores(q, w, values, slots, 0.3)
    for choice in ("triton", "torch"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        out = backend.indexer_scores(q, w, cache, slots, 0.3, key_format="mxfp4")
        torch.testing.assert_close(out, ref, **KERNEL_TOL[torch.float32])
    with pytest.raises(ValueError, match=r"mxfp4 record of Di=64: 34 bytes\], got \(6, 4, 1, 1, 17\)"):
        indexer_scores(torch.randn(3, 4, 64).to(device), w, cache, slots, 0.3, key_format="mxfp4")
    with pytest.raises(ValueError, match=r"Di=32\], got \(6, 4, 1, 1, 17\)"):
        indexer_scores(q, w, cache, slots, 0.3)
