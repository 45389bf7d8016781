"""DEEPINFER_KERNEL_BACKEND dispatch: the layers give the same results through the
Triton kernels (the CPU interpreter here) as through the references."""

from __future__ import annotations

import pytest
import torch

from deepinfer import env
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import backend
from deepinfer.layers.attention import Attention
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding


def test_backend_choice(monkeypatch, device):
    x = torch.zeros(1, device=device)
    monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND", raising=False)
    assert env.kernel_backend() == "auto"
    assert backend.use_triton(x) == (device.type == "cuda")
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    assert not backend.use_triton(x)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "Triton")
    assert backend.use_triton(x)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_KERNEL_BACKEND='cuda'"):
        backend.use_triton(x)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.use_triton(torch.zeros(1))


def run_layers(device: torch.device) -> list[torch.Tensor]:
    """RMSNorm, RoPE and a cached Attention step (a 5-token chunk and two decodes) on random data."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    norm = RMSNorm(32, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
    x = torch.randn(6, 32, generator=gen).to(device)
    rope = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 10000.0}).to(device)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 2, 3, 4, 9, 2], device=device))
    qk = torch.randn(7, hq, d, generator=gen).to(device)
    q2, k2 = RotaryEmbedding.apply_qk(qk.clone(), qk[:, :hkv].clone(), cos, sin)

    attn = Attention(hq, hkv, d, scale=0.25, dtype=torch.float32, sliding_window=6)
    attn.kv_cache = torch.randn(8, bs, 2, hkv, d, generator=gen).to(device)
    attn.group_id = 0
    # seq 0: chunk at positions 3..7; seq 1: decode at 9; seq 2: decode at 2.
    table = torch.tensor([[3, 5, 0], [1, 2, 6], [7, 0, 0]], dtype=torch.int32, device=device)
    slots = torch.tensor([3 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 1, 7 * 4 + 2],
                         device=device)
    ctx = ForwardContext(positions=torch.tensor([3, 4, 5, 6, 7, 9, 2], device=device),
                         query_start_loc=[0, 5, 6, 7], seq_lens=[8, 10, 3],
                         groups=[GroupMetadata(block_size=bs, block_table=table, slot_mapping=slots)])
    q = torch.randn(7, hq * d, generator=gen).to(device)
    k = torch.randn(7, hkv * d, generator=gen).to(device)
    v = torch.randn(7, hkv * d, generator=gen).to(device)
    out = attn(q, k, v, ctx)
    return [norm(x), RotaryEmbedding.apply(qk, cos, sin), q2, k2, out, attn.kv_cache]


def test_layers_agree_across_backends(monkeypatch, device):
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    expected = run_layers(device)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    got = run_layers(device)
    for name, a, b in zip(["rms_norm", "rope", "rope_q", "rope_k", "attention", "kv_cache"], got,
                          expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
