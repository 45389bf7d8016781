"""Kernels whose outputs feed FP8 linears quantise them in their own launch: the q_a norm (for
q_b and the indexer's q_b), each hyper-connection's collapse with its norm (for the attention's
input projections and the shared expert's gate and up), and the shared expert's SwiGLU (for its
down projection); the linears then skip their act-quant launch (kernels/backend.attach_fp8).

The tiny DeepSeek-V4 checkpoint and the embedded DeepSeek-V4.1 quantised to FP8 at load in
V4.1's 32 x 32 blocks with UE8M0 scales (their q_lora and expert widths are below V4's 128-wide
blocks), on the Triton path
(Triton's CPU interpreter): the tokens and logprobs equal those of the same engine with the producers'
quantisation switched off, bit for bit, with fewer act-quant launches.
"""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.kernels import fp8_gemm
from deepinfer.layers.deepseek_v4_common import RMSNorm
from deepinfer.layers.deepseek_v4_moe import DeepseekV4SharedExpert
from deepinfer.layers.hyper_connection import HyperConnection

from .. import TINY_V4_MODEL
from .test_tiny_v4_model import PROMPTS


@pytest.mark.slow
@pytest.mark.parametrize("model", [TINY_V4_MODEL, DEFAULT_MODEL], ids=["v4", "v41"])
def test_fp8_inputs_quantised_by_their_producers(model, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    path = shutil.copytree(model, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    for section in (config, config.get("text_config")):
        if section is not None:
            section["quantization_config"] = {"weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    (path / "config.json").write_text(json.dumps(config))
    launches: list[int] = []
    real = fp8_gemm.fp8_act_quant

    def counted(*args, **kwargs):
        launches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_gemm, "fp8_act_quant", counted)
    llm = LLM(model=str(path), device="cpu", quantization="fp8", max_num_batched_tokens=32, block_size=8,
              enable_prefix_caching=False)
    model = llm.engine.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.fp8_out is not None]
    connections = [m for m in model.modules() if isinstance(m, HyperConnection) and m.fp8_out is not None]
    shared = [m for m in model.modules() if isinstance(m, DeepseekV4SharedExpert) and m.fp8_act is not None]
    layers = len(model.model.layers)
    assert (len(norms), len(connections), len(shared)) == (layers, 2 * layers, layers)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(p, add_special_tokens=False)[:12]} for p in PROMPTS[:2]]

    def run() -> tuple[list, int]:
        launches.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs], len(launches)

    fused, fused_launches = run()
    for m in norms + connections:
        m.fp8_out = None
    for m in shared:
        m.fp8_act = None
    plain, plain_launches = run()
    assert fused == plain
    # Per layer and forward: q_b and the indexer's q_b, q_a/kv, gate/up and down.
    assert plain_launches > fused_launches > 0, (plain_launches, fused_launches)
