"""Where the tiny V4.1 release checkpoint's CUDA forward (quantization "auto": FP8 projections, FP4
experts) leaves the CPU one (the references): one prefill of the prompts on each (lengths from
``--lens``, default 30 and 7 in one batch, as tests/gpu/test_quant_gpu.py), every decoder layer's
attention, MoE, engram and layer output compared in execution order (relative error of the CUDA
output against the CPU output: a jump names the first module whose result moves; later ones may
only inherit it), then each MoE and engram replayed on the CPU with the CUDA module's own input
(its own error, not its input's drift).

    python scripts/probes/v41_quant_drift_cuda_vs_cpu.py               # on a GPU, ~1 minute
    python scripts/probes/v41_quant_drift_cuda_vs_cpu.py --lens 30 --eager
    python scripts/probes/v41_quant_drift_cuda_vs_cpu.py --poison      # uninitialised memory is NaN
    TRITON_INTERPRET=1 python scripts/probes/v41_quant_drift_cuda_vs_cpu.py   # no GPU: the kernels
                                                                              # in the interpreter
"""

from __future__ import annotations

import argparse
import os

import torch

from deepinfer import LLM, SamplingParams
from tests.unit.test_load_shipped import V41_CHECKPOINT

KINDS = ("self_attn", "mlp", "engram")


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((first_tensor(o) for o in out if first_tensor(o) is not None), None)
    return None


def to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x


def watched(model) -> dict[str, torch.nn.Module]:
    out = {}
    for name, m in model.named_modules():
        parts = name.split(".")
        if len(parts) == 3 and parts[:2] == ["model", "layers"]:
            out[name] = m
        elif len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in KINDS:
            out[name] = m
    return out


def record(model, keep_inputs: bool) -> list:
    log = []
    for name, m in watched(model).items():
        def fn(module, args, kwargs, out, name=name):
            t = first_tensor(out)
            log.append((name, None if t is None else t.detach().float().cpu(),
                        (to_cpu(args), to_cpu(kwargs)) if keep_inputs else None))
        m.register_forward_hook(fn, with_kwargs=True)
    return log


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", default="30,7", help="prompt lengths, one batch")
    parser.add_argument("--eager", action="store_true", help="CUDA engine with enforce_eager")
    parser.add_argument("--poison", action="store_true",
                        help="fill every uninitialised allocation (torch.empty and friends) with NaN / the "
                             "integer maximum, so a read of memory nothing wrote shows up off the GPU too")
    args = parser.parse_args()
    if args.poison:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in map(int, args.lens.split(","))]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    cpu = LLM(model=str(V41_CHECKPOINT), device="cpu", dtype="float32", quantization="fp8+mxfp4-experts",
              max_model_len=128)
    cpu_log = record(cpu.engine.model, keep_inputs=False)
    cpu_out = cpu.generate(prompts, params, use_tqdm=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # No GPU: the second engine runs the Triton kernels in the interpreter (the CUDA path's
        # kernels and packed KV records) against the first's torch references.
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("without a GPU run with TRITON_INTERPRET=1 (the Triton kernels in the interpreter)")
        os.environ["DEEPINFER_KERNEL_BACKEND"] = "triton"
    # On the CPU "auto" dequantises: keep the release's formats as the first engine does.
    quantization = "auto" if device == "cuda" else "fp8+mxfp4-experts"
    gpu = LLM(model=str(V41_CHECKPOINT), device=device, dtype="float32", quantization=quantization, max_model_len=128,
              gpu_memory_utilization=0.3, enforce_eager=args.eager)
    gpu_log = record(gpu.engine.model, keep_inputs=True)
    gpu_out = gpu.generate(prompts, params, use_tqdm=False)
    lp = [(a[t].logprob, b[t].logprob) for p, c, d in zip(prompts, cpu_out, gpu_out)
          for t, a, b in zip(p[1:], c.prompt_logprobs[1:], d.prompt_logprobs[1:])]
    diffs = torch.tensor([abs(a - b) for a, b in lp])
    print(f"prompt logprobs ({len(lp)} positions): median |diff| {diffs.median():.3e}, max {diffs.max():.3e}")
    print(f"{'module':32s} {'rel err':>10s}  (CUDA output vs CPU output, execution order)")
    for (name, a, _), (name2, b, _) in zip(gpu_log, cpu_log):
        assert name == name2, (name, name2)
        if a is not None and b is not None and a.shape == b.shape:
            print(f"{name:32s} {rel(a, b):10.3e}")
    print("own error: the CPU module given the CUDA module's input")
    cpu_mods = watched(cpu.engine.model)
    for name, out, inputs in gpu_log:
        if name.split(".")[-1] not in ("mlp", "engram") or out is None:
            continue
        args, kwargs = inputs
        try:
            with torch.no_grad():
                ref = first_tensor(cpu_mods[name](*args, **kwargs))
        except Exception as exc:       # a module that needs the engine's forward context
            print(f"{name:32s} not replayable alone: {type(exc).__name__}: {exc}"[:160])
            continue
        print(f"{name:32s} {rel(out, ref.float()):10.3e}")


if __name__ == "__main__":
    main()
