"""Expert-parallel MoE layers on CUDA with the Triton kernels (run on the GPU machine:
``pytest -m gpu tests/parallel/test_expert_parallel_gpu.py``): one rank with redundant slots,
tile-packed weights (``after_load``'s layout), both dispatch paths, against the plain
single-device layer; and a weight move on packed weights changes no output."""

from __future__ import annotations

import pytest
import torch

from deepinfer.layers.deepseek_v4_moe import DeepseekV4Experts
from deepinfer.layers.moe import FusedMoE
from deepinfer.parallel.balancer import move_experts
from deepinfer.parallel.expert import ExpertParallelConfig, initial_placement, use_expert_parallel

pytestmark = pytest.mark.gpu

E, H, I, T, K, R = 8, 256, 64, 200, 2, 4        # widths the packed tiles divide
CUDA = torch.device("cuda")


def make(cls, ep_config: ExpertParallelConfig | None, dtype: torch.dtype, **kwargs) -> FusedMoE:
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / 16, torch.randn(E, H, I, generator=g) / 8
    with torch.device(CUDA):
        if ep_config is None:
            layer = cls(E, H, I, **kwargs)
            slots = torch.arange(E)
        else:
            with use_expert_parallel(ep_config):
                layer = cls(E, H, I, **kwargs)
            slots = initial_placement(E, E + ep_config.num_redundant_experts)
    with torch.no_grad():
        layer.gate_up_proj.data = gate_up[slots].to(CUDA, dtype)
        layer.down_proj.data = down[slots].to(CUDA, dtype)
    if layer.packing_helps():
        layer.pack_weights()
    return layer


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dispatch", ["allgather", "alltoall"])
@pytest.mark.parametrize("cls, kwargs", [(FusedMoE, {}), (DeepseekV4Experts, {"swiglu_limit": 0.5})])
def test_ep_layer_matches_plain_layer(dtype, rtol, dispatch, cls, kwargs):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(CUDA, dtype)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    w, ids = w.to(CUDA), ids.to(CUDA)
    plain = make(cls, None, dtype, **kwargs)
    layer = make(cls, ExpertParallelConfig(R, dispatch), dtype, **kwargs)
    assert layer.packed == (dtype == torch.bfloat16)
    ref = plain(x, w, ids).float()
    out = layer(x, w, ids).float()
    assert (out - ref).abs().max() <= rtol * ref.abs().max()
    assert int(layer.ep.take_load().sum()) == T * K
    # Replicas of the experts in reverse order, expert 3 three times.
    move_experts(layer, torch.tensor([7, 6, 5, 4, 3, 2, 1, 0, 3, 3, 1, 2]))
    assert (layer(x, w, ids).float() - ref).abs().max() <= rtol * ref.abs().max()


def test_graph_capture_is_refused():
    layer = make(FusedMoE, ExpertParallelConfig(R, "allgather"), torch.float32)
    x = torch.randn(4, H, device=CUDA)
    w, ids = torch.randn(4, E, device=CUDA).softmax(-1).topk(K)
    with pytest.raises(NotImplementedError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(x, w, ids)
