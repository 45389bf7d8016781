"""Fused projections of DeepSeek-V4 (layers/fused_linear.py, ``after_load``).

- The fused model gives the unfused model's logits (cache-free forward, paged mixed
  batches with decode_only steps, the MTP layer) with fewer GEMMs: one per attention
  layer for all projections of its input, one for the shared expert's gate and up.
- The pieces' parameters are views of the fused buffers: the parameter storage is
  the same number of bytes as unfused, names and state_dict unchanged.
- Weights written in place after fusion (load_state_dict) are seen; a parameter
  replaced after fusion makes the forward raise instead of computing stale values.
- ``load_model`` (dummy weights) runs the hook.
- On CUDA (``pytest -m gpu``): bf16 fused vs unfused logits.

Model: the tiny HF-style config of test_deepseek_v4 (sliding, CSA, HCA layers; MTP).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.layers.deepseek_v4_attention import CSA, HCA, SLIDING, DeepseekV4Attention
from deepinfer.layers.deepseek_v4_moe import DeepseekV4SharedExpert
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.dummy import init_dummy_weights
from deepinfer.models.loader import _default_dtype, load_model

from .test_deepseek_v4 import HF_STYLE, our_logits, prompts, randomize, rel_err
from .test_deepseek_v4_batched import MIXED_LENS, MIXED_SCHEDULE, run_paged

CPU = torch.device("cpu")
# Same dot product per output column; only the GEMM's blocking may differ.
FUSED_RTOL = 1e-5


def build(config: dict, seed: int) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(config, torch.float32).eval()
    randomize(model, seed, config["n_routed_experts"], config["num_experts_per_tok"])
    return model


@pytest.fixture(scope="module")
def pair() -> tuple[DeepseekV4ForCausalLM, DeepseekV4ForCausalLM]:
    """(unfused, fused) copies of one random model."""
    unfused = build(HF_STYLE, seed=5)
    fused = copy.deepcopy(unfused)
    fused.after_load()
    return unfused, fused


class MatmulCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_fused_logits_equal_unfused_with_fewer_gemms(pair):
    unfused, fused = pair
    seqs = prompts([40, 13, 27], HF_STYLE["vocab_size"], seed=3)
    counts = []
    for model in pair:
        with MatmulCounter() as counter:
            our_logits(model, seqs)
        counts.append(counter.count)
    for b, (want, got) in enumerate(zip(our_logits(unfused, seqs), our_logits(fused, seqs))):
        assert rel_err(got, want) <= FUSED_RTOL, (b, rel_err(got, want))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Per layer, one GEMM replaces: sliding 2 (q_a, kv), HCA 4 (+ compressor kv, gate),
    # CSA 7 (+ indexer kv, gate, weights); the shared expert's 2 (gate, up) in every layer.
    saved = {SLIDING: 1, HCA: 3, CSA: 6}
    layers = HF_STYLE["layer_types"]
    assert counts[0] - counts[1] == sum(saved[t] for t in layers) + len(layers)


def test_fused_paged_and_mtp_equal_unfused(pair):
    unfused, fused = pair
    seqs = prompts(MIXED_LENS, HF_STYLE["vocab_size"], seed=31)
    want = run_paged(unfused, seqs, MIXED_SCHEDULE, decode_only_max_len=32)
    got = run_paged(fused, seqs, MIXED_SCHEDULE, decode_only_max_len=32)
    for b in range(len(seqs)):
        assert rel_err(got[b], want[b]) <= FUSED_RTOL, (b, rel_err(got[b], want[b]))
    assert len(fused.mtp) == 1
    ids = torch.cat(seqs)
    ctx = ForwardContext.no_cache(MIXED_LENS, CPU)
    with torch.no_grad():
        outs = [m.mtp_forward(m.forward_streams(ids, ctx), ids.roll(-1), ctx)[0] for m in pair]
    assert rel_err(outs[1], outs[0]) <= FUSED_RTOL


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_parameters_are_views_of_the_fused_buffers(pair):
    unfused, fused = pair
    attentions = [m for m in fused.modules() if isinstance(m, DeepseekV4Attention)]
    experts = [m for m in fused.modules() if isinstance(m, DeepseekV4SharedExpert)]
    assert len(attentions) == len(experts) == len(HF_STYLE["layer_types"]) + 1   # + MTP layer
    for proj in [a.input_proj for a in attentions] + [e.gate_up for e in experts]:
        assert proj.fused
        rows = 0
        for lin in proj.linears:
            w = lin.weight
            assert w.untyped_storage().data_ptr() == proj.weight.untyped_storage().data_ptr()
            assert w.data_ptr() == proj.weight[rows].data_ptr() and w.is_contiguous()
            assert torch.equal(w, proj.weight[rows:rows + w.shape[0]])
            rows += w.shape[0]
        assert rows == proj.weight.shape[0]
    csa = next(a for a in attentions if a.compressor is not None and a.compressor.indexer is not None)
    assert len(csa.input_proj.linears) == 7
    # Memory not doubled: the fused buffers replace the pieces' own storage.
    assert storage_bytes(fused) == storage_bytes(unfused)
    # Names and values unchanged.
    want, got = unfused.state_dict(), fused.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_in_place_reload_is_seen_and_replacement_raises():
    model = build(HF_STYLE, seed=5)
    model.after_load()
    other = build(HF_STYLE, seed=6)
    seqs = prompts([21], HF_STYLE["vocab_size"], seed=4)
    model.load_state_dict(other.state_dict())                 # copies into the fused buffers
    assert rel_err(our_logits(model, seqs)[0], our_logits(other, seqs)[0]) <= FUSED_RTOL
    attn = model.model.layers[1].self_attn
    attn.compressor.indexer.scorer.weights_proj.weight = torch.nn.Parameter(
        attn.compressor.indexer.scorer.weights_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"projection\(s\) \[6\].*call fuse_projections\(\) again"):
        our_logits(model, seqs)
    attn.fuse_projections()
    assert rel_err(our_logits(model, seqs)[0], our_logits(other, seqs)[0]) <= FUSED_RTOL


def test_load_model_fuses_dummy_weights():
    config = ModelConfig.from_hf_config(dict(HF_STYLE), "tiny", "float32", None, CPU, load_format="dummy")
    model = load_model(config, CPU)
    assert all(m.input_proj.fused for m in model.modules() if isinstance(m, DeepseekV4Attention))
    assert all(m.gate_up.fused for m in model.modules() if isinstance(m, DeepseekV4SharedExpert))


@pytest.mark.gpu
def test_cuda_bf16_fused_matches_unfused():
    """load_model's fused model vs the same dummy weights unfused, bf16 on CUDA (Triton backend)."""
    cuda = torch.device("cuda")
    config = ModelConfig.from_hf_config(dict(HF_STYLE), "tiny", "bfloat16", None, cuda, load_format="dummy")
    fused = load_model(config, cuda, seed=7)
    with torch.device(cuda), _default_dtype(torch.bfloat16):
        unfused = DeepseekV4ForCausalLM(dict(HF_STYLE), torch.bfloat16).eval()
    init_dummy_weights(unfused, seed=7)
    assert fused.model.layers[1].self_attn.input_proj.fused
    assert not unfused.model.layers[1].self_attn.input_proj.fused
    seqs = [s.to(cuda) for s in prompts([40, 13, 27], HF_STYLE["vocab_size"], seed=3)]
    with torch.no_grad():
        ctx = ForwardContext.no_cache([len(s) for s in seqs], cuda)
        want, got = (m.compute_logits(m(torch.cat(seqs), ctx)) for m in (unfused, fused))
    # bf16: cuBLAS may block a wider GEMM differently, so rounding may differ slightly.
    assert rel_err(got, want) <= 2e-2, rel_err(got, want)
