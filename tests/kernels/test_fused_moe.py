"""The fused MoE kernels (align by expert, gate_up + SwiGLU, down + weight) against
reference.moe_experts / reference.clamped_moe_experts on random data.

The CPU interpreter multiplies bfloat16 tiles wrongly (see tests/kernels/conftest.py),
so the CPU sweep runs float32 and float16; bfloat16 runs on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.fused_moe import (
    DOWN_TILE,
    GATE_UP_TILE,
    MoEConfig,
    _weight_loads,
    fused_moe,
    max_padded_pairs,
    moe_align,
    pack_expert_weights,
    pick_config,
    unpack_expert_weights,
)
from deepinfer.layers.deepseek_v4_moe import DeepseekV4Experts, DeepseekV4Router
from deepinfer.layers.moe import FusedMoE, SoftmaxTopKRouter
from deepinfer.models.base import CausalLM

from .conftest import capture

ON_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 1e-2, "atol": 2e-3},
       torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}


def make_experts(e: int, h: int, i: int, dtype: torch.dtype, device, seed: int = 0):
    """Expert weights scaled so gate/up/down outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    down = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return gate_up.to(dtype).to(device), down.to(dtype).to(device)


def make_routing(t: int, k: int, experts: list[int], device, seed: int = 0):
    """Each token picks k distinct experts from ``experts`` (the others get no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=gen)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.1
    return weights.to(device), ids.to(device)


@pytest.mark.parametrize("t", [1, 5, 33, 2100])     # 2100: prefill's 4096-id steps, the last partial
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_sorts_every_pair_into_its_experts_blocks(t, block_m, device):
    e, k = 8, 2
    _, ids = make_routing(t, k, [0, 2, 3, 5, 6], device, seed=t)      # experts 1, 4, 7 get nothing
    ids[0, 1] = -1                                                     # taken by no expert
    pairs = t * k
    out = torch.full((pairs, 24), 7.0, device=device)
    sorted_pairs, block_expert, num_padded = moe_align(ids, e, block_m, out)
    n = int(num_padded)
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert n <= sorted_pairs.numel() == max_padded_pairs(pairs, e, block_m)
    used = sorted_pairs[:n].cpu()
    real = used[used < pairs]
    assert sorted(real.tolist()) == [p for p in range(pairs) if flat[p] >= 0]   # each pair once
    assert (used[used >= pairs] == pairs).all()                                # padding marks
    experts_of_rows = block_expert[:n // block_m].cpu().repeat_interleave(block_m).long()
    assert torch.equal(flat[real.long()], experts_of_rows[used < pairs])      # pair sits in its expert's block
    assert (out[1] == 0).all() and (out[0] == 7).all() and (out[2:] == 7).all()  # only the -1 pair's row zeroed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("e,h,i", [(4, 32, 64), (8, 64, 48)])
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_fused_moe_matches_reference(dtype, t, e, h, i, limit, device, poison_empty):
    gate_up, down = make_experts(e, h, i, dtype, device, seed=e + t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype).to(device)
    weights, ids = make_routing(t, 2, list(range(e - 1)), device, seed=h + t)   # expert e-1 stays empty
    out = fused_moe(x, gate_up, down, weights, ids, limit)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    # The references in float32 from the same (rounded) inputs: the kernel accumulates in float32.
    args = (x.float(), gate_up.float(), down.float(), weights, ids)
    ref = reference.clamped_moe_experts(*args, limit)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    if limit:
        assert (ref - reference.clamped_moe_experts(*args, 0.0)).abs().max() > 0.05   # the clamp binds
    else:
        torch.testing.assert_close(out.float(), reference.moe_experts(*args), **TOL[dtype])


def test_fused_moe_skips_ids_outside_the_experts(device, poison_empty):
    """-1 (an expert held by another rank) contributes nothing, like a slot with weight 0."""
    e, h, i, t = 4, 32, 32, 5
    gate_up, down = make_experts(e, h, i, torch.float32, device)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(device)
    weights, ids = make_routing(t, 2, list(range(e)), device, seed=3)
    ids[1, 0] = -1
    ids[3, :] = -1
    out = fused_moe(x, gate_up, down, weights, ids, 0.0)
    ref = reference.moe_experts(x, gate_up, down, weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("config", [MoEConfig(16, 16, 16, 16, 16, 1, 4, 2), MoEConfig(32, 32, 32, 32, 16, 2, 4, 2)])
def test_fused_moe_tile_configs(config, device, poison_empty):
    """Tiles smaller than the problem: several N-tiles, a reduction loop over K with a
    ragged tail (H=40, I=24), grouped program order."""
    e, h, i, t = 6, 40, 24, 9
    gate_up, down = make_experts(e, h, i, torch.float32, device, seed=5)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(device)
    weights, ids = make_routing(t, 3, list(range(e)), device, seed=5)
    out = fused_moe(x, gate_up, down, weights, ids, 0.7, config=config)
    torch.testing.assert_close(out, reference.clamped_moe_experts(x, gate_up, down, weights, ids, 0.7),
                               rtol=1e-5, atol=1e-5)


VARIANTS = {"pointers": {"tma": False, "sorted_act": False}, "tma": {"tma": True},
            "sorted_act": {"sorted_act": True}, "tma+sorted_act": {"tma": True, "sorted_act": True}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", [(16, 16, 16, 16, 16, 1), (32, 32, 32, 32, 16, 2)])
def test_fused_moe_prefill_variants(variant, dtype, tiles, device, poison_empty):
    """The prefill path's operand options (TMA descriptors, expert-sorted act rows) on tiles smaller than the problem: ragged K and N tails (H=40, I=24), a
    slot taken by no expert, and NaN in every buffer row the kernels leave unwritten (padding
    rows of the sorted operands must feed only tile rows that are never stored)."""
    e, h, i, t = 6, 40, 24, 9
    gate_up, down = make_experts(e, h, i, dtype, device, seed=7)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
    weights, ids = make_routing(t, 3, list(range(e)), device, seed=7)
    ids[2, 1] = -1
    config = MoEConfig(*tiles, num_warps=4, num_stages=2, **VARIANTS[variant])
    out = fused_moe(x, gate_up, down, weights, ids, 0.7, config=config)
    ref = reference.clamped_moe_experts(x.float(), gate_up.float(), down.float(),
                                        weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0), 0.7)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_fused_moe_tma_needs_stacked_experts(device):
    """A TMA config reads each weight tensor as one [E*N, K] matrix; experts that are not
    stacked that way are refused rather than read wrongly."""
    e, h, i, t = 4, 32, 16, 3
    gate_up, down = make_experts(e, h, i, torch.float32, device)
    gapped = torch.zeros(e, 2 * i + 4, h, device=device)[:, :2 * i]      # expert stride of 2I + 4 rows
    gapped.copy_(gate_up)
    x = torch.randn(t, h, device=device)
    weights, ids = make_routing(t, 2, list(range(e)), device)
    config = MoEConfig(16, 16, 16, 16, 16, 1, 4, 2, tma=True)
    with pytest.raises(ValueError, match="gate_up_proj"):
        fused_moe(x, gapped, down, weights, ids, config=config)
    torch.testing.assert_close(fused_moe(x, gapped, down, weights, ids),        # the pointer path reads it
                               fused_moe(x, gate_up, down, weights, ids), rtol=0, atol=0)


def test_pick_config_by_tokens_per_expert():
    v4 = {"top_k": 6, "num_experts": 256, "hidden": 4096, "inter": 2048}
    assert pick_config(1, **v4).block_m == pick_config(64, **v4).block_m == 16
    assert pick_config(4096, **v4).block_m >= 64
    tiny = pick_config(4096, top_k=2, num_experts=4, hidden=32, inter=48)
    assert (tiny.block_k1, tiny.block_n1, tiny.block_n2) == (32, 64, 32)     # never past the problem


def test_fused_moe_rejects_mismatched_shapes(device):
    gate_up, down = make_experts(4, 32, 16, torch.float32, device)
    x = torch.randn(3, 32, device=device)
    weights, ids = make_routing(3, 2, [0, 1, 2, 3], device)
    with pytest.raises(ValueError, match="down_proj has shape"):
        fused_moe(x, gate_up, down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x, gate_up, down, weights[:2], ids)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe(x.double(), gate_up, down, weights, ids)


def test_layers_match_across_backends(device, monkeypatch):
    """The MoE layers give the same result through the Triton kernels and the torch references."""
    gen = torch.Generator().manual_seed(11)
    e, h, i, t, k = 6, 32, 32, 7, 2
    x = torch.randn(t, h, generator=gen).to(device)
    input_ids = torch.randint(0, 20, (t,), generator=gen).to(device)
    v4_router = DeepseekV4Router(h, e, k, "sqrtsoftplus", 1.5, None).to(device)
    hash_router = DeepseekV4Router(h, e, k, "sqrtsoftplus", 1.5, 20).to(device)
    qwen_router = SoftmaxTopKRouter(h, e, k, renormalize=True).to(device)
    v4_experts = DeepseekV4Experts(e, h, i, swiglu_limit=0.6).to(device)
    experts = FusedMoE(e, h, i).to(device)
    with torch.no_grad():
        for module in (v4_router, hash_router, qwen_router, v4_experts, experts):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / h ** 0.5)
        v4_router.e_score_correction_bias.copy_(torch.randn(e, generator=gen))
        hash_router.tid2eid.copy_(torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(20)]))

    def run():
        w, ids = v4_router(x, input_ids)
        hw, hids = hash_router(x, input_ids)
        qw, qids = qwen_router(x)
        return (w, ids, hw, hids, qw, qids, v4_experts(x, w, ids), v4_experts(x, hw, hids),
                experts(x, qw, qids))

    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    ref = run()
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    got = run()
    for (w_a, ids_a), (w_b, ids_b) in zip(zip(got[0:6:2], got[1:6:2]), zip(ref[0:6:2], ref[1:6:2])):
        ids_a, order_a = ids_a.sort(-1)
        ids_b, order_b = ids_b.sort(-1)
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(w_a.gather(1, order_a), w_b.gather(1, order_b))
    for a, b in zip(got[6:], ref[6:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pack_expert_weights_tiles_and_round_trip():
    """Each [tile_n, tile_k] tile is one contiguous run, tiles in (n-tile, k-tile) order inside
    an expert, experts along dim 0; unpacking restores the stacked tensor."""
    e, n, k, tn, tk = 3, 8, 12, 4, 6
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(0))
    packed = pack_expert_weights(w, tn, tk)
    assert packed.shape == (e, (n // tn) * (k // tk) * tn, tk) and packed.is_contiguous()
    flat = packed.reshape(-1)
    for ex, row, col in [(0, 0, 0), (1, 5, 7), (2, 7, 11), (2, 3, 6)]:
        tile = (ex * (n // tn) + row // tn) * (k // tk) + col // tk
        assert flat[tile * tn * tk + (row % tn) * tk + col % tk] == w[ex, row, col]
    assert torch.equal(packed[1], pack_expert_weights(w[1:2], tn, tk)[0])      # whole experts index
    assert torch.equal(unpack_expert_weights(packed, n, k, tn, tk), w)
    with pytest.raises(ValueError, match="N must be a multiple of 5"):
        pack_expert_weights(w, 5, tk)
    with pytest.raises(ValueError, match="K of 8"):
        pack_expert_weights(w, tn, 8)
    with pytest.raises(ValueError, match="got shape"):
        unpack_expert_weights(packed, n, k, 2 * tn, tk // 2)                     # other tiles


# Widths the packed tiles divide: H a multiple of 256 (down's tile_n), I of 64.
PACKED_CONFIGS = {
    # decode: 128-wide K steps span two 64-wide tiles
    "decode": (64, 5, MoEConfig(16, 32, 128, 64, 128, 1, num_warps=4, num_stages=2)),
    # K steps narrower than a tile, N-tiles narrower than one
    "small_blocks": (64, 5, MoEConfig(16, 16, 32, 32, 32, 2, num_warps=4, num_stages=2)),
    # ragged: I=192 leaves half of GEMM1's second N-tile and of GEMM2's last K step masked
    "ragged": (192, 5, MoEConfig(16, 128, 128, 64, 128, 2, num_warps=4, num_stages=2)),
    # TMA boxes inside one tile (block_k = 64) for both GEMMs
    "tma": (128, 9, MoEConfig(16, 64, 64, 128, 64, 2, num_warps=4, num_stages=2, tma=True, sorted_act=True)),
    # I=192 is no multiple of block_n1=128, so up's boxes would straddle tiles: gate_up falls back
    # to pointer loads, down keeps TMA
    "tma_fallback": (192, 9, MoEConfig(16, 128, 64, 256, 64, 2, num_warps=4, num_stages=2, tma=True,
                                       sorted_act=True)),
    # pick_config's prefill choice (T*K/E = 36 pairs per expert: TMA, sorted act)
    "picked_prefill": (64, 72, None),
}


@pytest.mark.parametrize("case", PACKED_CONFIGS)
def test_fused_moe_packed_weights_match_stacked(case, device, poison_empty):
    """Packed weights give bitwise the output of the stacked ones under the same config, on the
    pointer path (blocks that do and do not match the tiles, ragged tails) and on the TMA path."""
    i, t, config = PACKED_CONFIGS[case]
    e, h, k = 4, 256, 2
    gate_up, down = make_experts(e, h, i, torch.float16, device, seed=13)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(13)).to(torch.float16).to(device)
    weights, ids = make_routing(t, k, list(range(e)), device, seed=13)
    ids[1, 0] = -1
    packed = (pack_expert_weights(gate_up, *GATE_UP_TILE), pack_expert_weights(down, *DOWN_TILE))
    expect = fused_moe(x, gate_up, down, weights, ids, 0.7, config=config)
    got = fused_moe(x, *packed, weights, ids, 0.7, config=config, packed=True)
    assert torch.equal(got, expect)
    ref = reference.clamped_moe_experts(x.float(), gate_up.float(), down.float(),
                                        weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0), 0.7)
    torch.testing.assert_close(got.float(), ref, **TOL[torch.float16])
    cfg = config or pick_config(t, k, e, h, i)
    if case in ("tma", "picked_prefill"):                 # the packed TMA path, not the fallback
        assert _weight_loads(cfg, True, (cfg.block_n1, cfg.block_k1), GATE_UP_TILE, i, 2)[0]
        assert _weight_loads(cfg, True, (cfg.block_n2, cfg.block_k2), DOWN_TILE, h, 2)[0]
    if case == "tma_fallback":
        assert not _weight_loads(cfg, True, (cfg.block_n1, cfg.block_k1), GATE_UP_TILE, i, 2)[0]


def test_fused_moe_packed_rejects_other_layouts(device):
    e, h, i, t = 2, 256, 128, 3
    gate_up, down = make_experts(e, h, i, torch.float16, device)
    x = torch.randn(t, h, device=device).to(torch.float16)
    weights, ids = make_routing(t, 2, list(range(e)), device)
    with pytest.raises(ValueError, match="packed gate_up_proj has shape"):
        fused_moe(x, gate_up, down, weights, ids, packed=True)                   # stacked, not packed
    with pytest.raises(ValueError, match="packed down_proj"):
        fused_moe(x, pack_expert_weights(gate_up, *GATE_UP_TILE), down, weights, ids, packed=True)
    narrow = torch.randn(t, 64, device=device).to(torch.float16)               # H=64: no [256, 64] down tiles
    gu64, dn64 = make_experts(e, 64, i, torch.float16, device)
    with pytest.raises(ValueError, match="multiple of 256"):
        fused_moe(narrow, pack_expert_weights(gu64, *GATE_UP_TILE), dn64, weights, ids, packed=True)


class _TinyMoEModel(CausalLM):
    """A CausalLM holding only routed experts, for after_load and load_weights."""

    def __init__(self, experts: FusedMoE) -> None:
        super().__init__({}, torch.float16)
        self.experts = experts


def test_layer_packs_weights_in_place(device, monkeypatch):
    """after_load packs the experts where packing_helps (CUDA + Triton + 16-bit; forced here on the
    CPU), the Parameters stay and are repacked in place, the forward through the Triton kernels
    is bitwise unchanged and through the torch references still correct; loading into packed
    experts is refused until they are unpacked."""
    e, h, i, t = 4, 256, 64, 5
    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(t, h, generator=gen)).to(torch.float16).to(device)
    weights, ids = make_routing(t, 2, list(range(e)), device, seed=17)
    experts = DeepseekV4Experts(e, h, i, swiglu_limit=0.6).to(torch.float16).to(device)
    gate_up, down = make_experts(e, h, i, torch.float16, device, seed=17)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    model = _TinyMoEModel(experts)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    expect = experts(x, weights, ids)
    assert experts.packing_helps() == (device.type == "cuda")
    monkeypatch.setattr(FusedMoE, "packing_helps", lambda self: not self.packed)
    param = experts.gate_up_proj
    model.after_load()
    assert experts.packed and experts.gate_up_proj is param
    assert experts.gate_up_proj.shape == (e, 2 * i * h // 64, 64) and experts.down_proj.shape == (e, h * i // 64, 64)
    assert torch.equal(experts(x, weights, ids), expect)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    torch.testing.assert_close(experts(x, weights, ids).float(),
                               reference.clamped_moe_experts(x.float(), gate_up.float(), down.float(), weights,
                                                             ids, 0.6), **TOL[torch.float16])
    with pytest.raises(ValueError, match="unpack_weights"):
        model.load_weights([("experts.gate_up_proj", gate_up)])
    with pytest.raises(ValueError, match="unpack_weights"):
        experts.expert_weight_index("up_proj", 1)
    experts.unpack_weights()
    assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
    model.load_weights([("experts.gate_up_proj", gate_up), ("experts.down_proj", down)])


@pytest.fixture(scope="module")
def v4_experts_gpu():
    """DeepSeek-V4-Flash widths: E=256, H=4096, I=2048, bfloat16 (12.9 GB)."""
    return make_experts(256, 4096, 2048, torch.bfloat16, "cuda", seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 16, 64, 4096])
def test_fused_moe_gpu_v4_sizes(t, v4_experts_gpu):
    gate_up, down = v4_experts_gpu
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 256, device="cuda")
    weights, ids = reference.biased_topk(logits, torch.zeros(256, device="cuda"), 6, "sqrtsoftplus", 1.5)
    out = fused_moe(x, gate_up, down, weights, ids, 10.0)
    ref = reference.clamped_moe_experts(x, gate_up, down, weights, ids, 10.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["pointers", "tma", "tma+sorted_act"])
def test_fused_moe_gpu_prefill_variants(variant, v4_experts_gpu):
    """The prefill operand options at T=4096 on V4-Flash widths: against the reference, and
    bitwise equal run to run (the sorted runs land in a different order each time)."""
    gate_up, down = v4_experts_gpu
    t = 4096
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    weights, ids = reference.biased_topk(torch.randn(t, 256, device="cuda"), torch.zeros(256, device="cuda"),
                                         6, "sqrtsoftplus", 1.5)
    base = pick_config(t, 6, 256, 4096, 2048)
    config = MoEConfig(**{**base.__dict__, **VARIANTS[variant]})
    out = fused_moe(x, gate_up, down, weights, ids, 10.0, config=config)
    ref = reference.clamped_moe_experts(x, gate_up, down, weights, ids, 10.0)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids, 10.0, config=config), out, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_fused_moe_gpu_cuda_graph(v4_experts_gpu):
    """Routing and experts captured once replay correctly for new tokens and new routes."""
    from deepinfer.kernels.moe_routing import topk_route
    gate_up, down = v4_experts_gpu
    t = 16
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1

    def forward():
        weights, ids = topk_route(logits, 6, "sqrtsoftplus", 1.5, True, bias)
        return fused_moe(x, gate_up, down, weights, ids, 10.0)

    forward()                                          # compile outside the capture
    graph, out = capture(forward)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, forward(), rtol=0, atol=0)   # same kernels, same tiles: bitwise
