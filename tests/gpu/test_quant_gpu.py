"""Quantised weights in the engine on a CUDA device (run on the GPU machine: ``pytest -m gpu
tests/gpu/test_quant_gpu.py``): the embedded tiny DeepSeek-V4.1 quantised at load runs the FP8
GEMM and FP4 MoE kernels on CUDA and gives the logprobs and tokens of the same quantised model on
the CPU, where the references compute it (float32 on both sides)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

NEW = 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantised_tiny_model_cuda_matches_cpu_reference():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 7, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=1, logprobs=5)
    results = {}
    for device in ("cpu", "cuda"):
        llm = LLM(device=device, dtype="float32", quantization="fp8+mxfp4-experts", max_model_len=256,
                  gpu_memory_utilization=0.3)
        assert llm.engine.model.weight_bytes["fp8"] > 0 and llm.engine.model.weight_bytes["fp4"] > 0
        results[device] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        ids = cpu.prompt_token_ids
        lp = [torch.tensor([o.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)])
              for o in (cpu, cuda)]
        assert (lp[0] - lp[1]).abs().max().item() < 2e-2
        got, want = cuda.outputs[0].token_ids, cpu.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first_diff is not None:  # an activation rounding flipped a near-tie: the CPU's token is in CUDA's top 5
            assert want[first_diff] in cuda.outputs[0].logprobs[first_diff]
