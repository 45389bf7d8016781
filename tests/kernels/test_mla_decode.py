"""Absorbed MLA decode: the reference against the layer's expanded attention
(MLAttention._attend), and the Triton kernel (deepinfer/kernels/mla_decode.py) against
the reference on random data."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import backend, reference
from deepinfer.kernels.mla_decode import MLADecodeConfig, mla_decode
from deepinfer.layers.mla import MLAConfig, MLAttention

# float16 stands in for bfloat16 on the CPU: the interpreter cannot multiply bfloat16 tiles.
KERNEL_TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5},
              torch.float16: {"rtol": 2e-3, "atol": 2e-3},
              torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}
FOREIGN = 40   # elements of another layer at the start of each page


def latent_cache(lens, bs, width, dtype, device, gen):
    """A layer's latent cache [NB, bs, 1, 1, width] as a strided view into pages shared with
    another layer, and its block table. Positions < lens[b] hold random entries in shuffled
    blocks; all else (the other layer, block 0 that pads the table, slots past a sequence's
    end) is NaN, so a read outside the visible entries shows."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    buffer = torch.full((nb, FOREIGN + bs * width), float("nan"), dtype=dtype)
    cache = buffer[:, FOREIGN:].view(nb, bs, 1, 1, width)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    rows = []
    for n, k in zip(lens, need):
        row = [perm.pop() for _ in range(k)]
        for j, blk in enumerate(row):
            used = min(bs, n - j * bs)
            cache[blk, :used] = torch.randn(used, 1, 1, width, generator=gen).to(dtype)
        rows.append(row)
    width_t = max(max(need), 1)
    table = torch.tensor([r + [0] * (width_t - len(r)) for r in rows], dtype=torch.int32)
    return buffer.to(device)[:, FOREIGN:].view(nb, bs, 1, 1, width), table.to(device)


def test_reference_matches_the_layers_expanded_attention():
    """Absorbing kv_b_proj's key half into q and applying its value half after attention
    gives MLAttention._attend's result for a decode query."""
    gen = torch.Generator().manual_seed(0)
    cfg = MLAConfig(hidden_size=32, num_heads=4, q_lora_rank=None, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, attention_bias=False,
                    rope_interleave=True, rope={"rope_type": "default"})
    layer = MLAttention(cfg, torch.float32)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=gen) * 0.3)
    lens = [5, 1, 11]
    cache, table = latent_cache(lens, 4, 20, torch.float32, "cpu", gen)
    q = torch.randn(3, 4, 12, generator=gen)                                     # [B, Nh, Dn + Dr]
    w = layer.kv_b_proj.weight.view(4, 8 + 6, 16)                                # [Nh, Dn + Dv, R]
    q_abs = torch.cat([torch.einsum("bhn,hnr->bhr", q[..., :8], w[:, :8]), q[..., 8:]], dim=-1)
    latent_out = reference.mla_decode(q_abs, cache, table, torch.tensor(lens), cfg.scale, 16, 11)
    out = torch.einsum("bhr,hvr->bhv", latent_out, w[:, 8:])                     # [B, Nh, Dv]
    for b, n in enumerate(lens):
        entries = reference.gather_kv(cache, table[b], 0, n)[:, 0, 0]
        expected = layer._attend(q[b:b + 1], entries, torch.tensor([n - 1]), torch.arange(n))
        torch.testing.assert_close(out[b:b + 1], expected, rtol=1e-5, atol=1e-5)


CASES = [
    # lens, nh, r, dr, bs, dtype, config (block_h, block_n, splits, warps, stages) or None
    ([9, 1, 17, 0, 70], 4, 32, 8, 4, torch.float32, None),
    ([9, 1, 17, 0, 70], 4, 32, 8, 4, torch.float32, MLADecodeConfig(16, 16, 3, 4, 2)),
    ([40, 33], 20, 64, 16, 16, torch.float16, MLADecodeConfig(16, 16, 2, 4, 2)),
    ([50, 3, 129], 6, 48, 0, 8, torch.float16, None),                          # no rope part
]


@pytest.mark.parametrize("lens,nh,r,dr,bs,dtype,config", CASES)
def test_triton_mla_decode_matches_reference(lens, nh, r, dr, bs, dtype, config, device, poison_empty):
    gen = torch.Generator().manual_seed(sum(lens))
    cache, table = latent_cache(lens, bs, r + dr, dtype, device, gen)
    q = torch.randn(len(lens), nh, r + dr, generator=gen).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = mla_decode(q, cache, table, seq_lens, 0.15, r, max(lens), config)
    ref = reference.mla_decode(q, cache, table, seq_lens, 0.15, r, max(lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


def test_triton_mla_decode_rejects_bad_inputs(device):
    cache = torch.zeros(2, 4, 1, 1, 24, device=device)
    q = torch.zeros(1, 2, 24, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cache is"):
        mla_decode(q.half(), cache, table, lens, 1.0, 16, 1)
    with pytest.raises(ValueError, match="below kv_lora_rank"):
        mla_decode(q, cache, table, lens, 1.0, 32, 1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        mla_decode(q, cache, table, lens.float(), 1.0, 16, 1)


def test_backend_mla_decode_dispatches(monkeypatch, device):
    gen = torch.Generator().manual_seed(2)
    lens = [6, 13]
    cache, table = latent_cache(lens, 4, 40, torch.float32, device, gen)
    q = torch.randn(2, 4, 40, generator=gen).to(device)
    seq_lens = torch.tensor(lens, device=device)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    out = backend.mla_decode(q, cache, table, seq_lens, 0.2, 32, 13)
    torch.testing.assert_close(out, reference.mla_decode(q, cache, table, seq_lens, 0.2, 32, 13),
                               **KERNEL_TOL[torch.float32])


# --- real shapes (DeepSeek-V3: 128 heads, R 512, Dr 64) on the GPU ------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx,dtype", [(1, 32768, torch.bfloat16), (16, 4096, torch.bfloat16),
                                             (64, 4096, torch.bfloat16), (8, 1000, torch.float32)])
def test_triton_mla_decode_gpu_sizes(batch, ctx, dtype, poison_empty):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen).tolist()
    cache, table = latent_cache(lens, 64, 576, dtype, torch.device("cuda"), gen)
    q = torch.randn(batch, 128, 576, generator=gen).to("cuda", dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = mla_decode(q, cache, table, seq_lens, 192 ** -0.5, 512, ctx)
    ref = reference.mla_decode(q, cache, table, seq_lens, 192 ** -0.5, 512, ctx)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_h,block_n,num_warps", [(16, 32, 4), (32, 32, 4), (64, 32, 8)])
def test_triton_mla_decode_gpu_configs(block_h, block_n, num_warps, poison_empty):
    """Every tile config gpu_kernel_check.py times compiles and is exact."""
    gen = torch.Generator().manual_seed(7)
    lens = [3000, 17, 2048, 1]
    cache, table = latent_cache(lens, 64, 576, torch.bfloat16, torch.device("cuda"), gen)
    q = torch.randn(4, 128, 576, generator=gen).to("cuda", torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    config = MLADecodeConfig(block_h, block_n, 8, num_warps, num_stages=2)
    out = mla_decode(q, cache, table, seq_lens, 192 ** -0.5, 512, 3000, config)
    torch.testing.assert_close(out, reference.mla_decode(q, cache, table, seq_lens, 192 ** -0.5, 512, 3000),
                               **KERNEL_TOL[torch.bfloat16])
