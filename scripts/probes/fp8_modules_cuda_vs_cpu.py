"""Each FP8 projection of the tiny V4.1 release checkpoint on CUDA against the same module on the
CPU, given the CUDA module's own input: a module whose own error is large (not one that only
inherits its input's drift) shows here. Prints the worst relative error per module kind."""

from __future__ import annotations

import collections

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.layers.quant_linear import Fp8Linear
from tests.unit.test_load_shipped import V41_CHECKPOINT

captured = []


def hook(name):
    def fn(module, args, out):
        captured.append((name, args[0].detach().cpu(), out.detach().cpu()))
    return fn


prompt = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(30)).tolist()
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
cpu = LLM(model=str(V41_CHECKPOINT), device="cpu", dtype="float32", quantization="fp8+mxfp4-experts",
          max_model_len=128)
cpu_modules = {n: m for n, m in cpu.engine.model.named_modules() if isinstance(m, Fp8Linear)}
gpu = LLM(model=str(V41_CHECKPOINT), device="cuda", dtype="float32", quantization="auto", max_model_len=128,
          gpu_memory_utilization=0.3, enforce_eager=True)
for n, m in gpu.engine.model.named_modules():
    if isinstance(m, Fp8Linear):
        m.register_forward_hook(hook(n))
gpu.generate([prompt], params, use_tqdm=False)
worst = collections.defaultdict(float)
for name, x, y in captured:
    with torch.no_grad():
        ref = cpu_modules[name](x)
    rel = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    kind = name.split(".")[-1] + ("" if cpu_modules[name].groups == 1 else f" (groups {cpu_modules[name].groups})")
    worst[kind] = max(worst[kind], rel)
    if rel > 1e-2:
        print(f"{name}: relative error {rel:.3e} over {tuple(x.shape)}")
for kind, rel in sorted(worst.items()):
    print(f"{kind:30s} worst relative error {rel:.3e}")
