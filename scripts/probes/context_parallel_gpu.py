"""Context parallelism on two CUDA devices (NCCL): does ``--cp 2`` give the single-device
outputs, and how much faster is a long prefill?

1. Outputs: Llama (a tiny random checkpoint), the tiny DeepSeek-V4 and the embedded V4.1 at
   cp=1 and cp=2 (and ep=2 x cp=2 on the MoE models), float32, prompts of 5, 3, 19, 42 and
   300 tokens under a 64-token budget: greedy tokens equal, largest prompt/sample logprob
   difference.
2. Speed: one prompt of ``--prompt-len`` tokens (default 8192) through a larger random Llama
   (bfloat16), whole in one step, ``max_tokens=1``: the mean time to first token at cp=1 and
   cp=2 over ``--iters`` runs after a warm-up.

    PYTHONPATH=. python scripts/probes/context_parallel_gpu.py [--device cuda] [--prompt-len 8192]

Writes ``$OUT/context_parallel_gpu.json`` (or ./ without $OUT) and prints it. On the CPU
(``--device cpu --prompt-len 256``) it runs the same code over gloo as a dry run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.entrypoints.llm import DEFAULT_MODEL  # noqa: E402
from tests.engine.conftest import make_checkpoint  # noqa: E402

TINY_V4 = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-v4-model"
LENGTHS = (5, 3, 19, 42, 300)


def outputs(path: Path, device: str, **options) -> tuple[list[list[int]], list[list[dict]]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3, logprobs=3)
    with LLM(model=str(path), device=device, dtype="float32", max_num_batched_tokens=64, max_model_len=512,
             **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:] + o.outputs[0].logprobs]
             for o in outs])


def compare(ref: tuple, got: tuple) -> dict:
    worst = 0.0
    for ref_seq, seq in zip(ref[1], got[1]):
        for ref_pos, pos in zip(ref_seq, seq):
            for t in ref_pos.keys() & pos.keys():
                worst = max(worst, abs(ref_pos[t] - pos[t]))
    return {"tokens_equal": ref[0] == got[0], "max_logprob_diff": worst}


def ttft(path: Path, device: str, prompt_len: int, iters: int, cp: int) -> float:
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with LLM(model=str(path), device=device, dtype="bfloat16" if device == "cuda" else "float32",
             max_num_batched_tokens=prompt_len, max_model_len=prompt_len + 8, context_parallel_size=cp,
             enable_prefix_caching=False) as llm:
        times = []
        for i in range(iters + 1):
            prompt = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if i:                       # the first run warms up
                times.append(time.perf_counter() - t0)
    return sum(times) / len(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    result: dict = {"device": args.device, "outputs": {}, "ttft_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        llama = make_checkpoint(root / "small", "LlamaForCausalLM", attention_bias=True)
        qwen_moe = make_checkpoint(root / "small", "Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
        models = {"LlamaForCausalLM": (llama, {}), "Qwen3MoeForCausalLM": (qwen_moe, {}),
                  "DeepseekV4ForCausalLM": (TINY_V4, {}),
                  "DeepseekV41ForCausalLM": (Path(DEFAULT_MODEL), {"kv_cache_dtype": "float32"})}
        for arch, (path, opts) in models.items():
            ref = outputs(path, args.device, **opts)
            runs = {"cp2": dict(context_parallel_size=2)}
            if arch != "LlamaForCausalLM":
                runs["ep2_cp2"] = dict(context_parallel_size=2, expert_parallel_size=2)
            for name, par in runs.items():
                result["outputs"][f"{arch}/{name}"] = compare(ref, outputs(path, args.device, **opts, **par))
                print(arch, name, result["outputs"][f"{arch}/{name}"], flush=True)
        big = make_checkpoint(root / "big", "LlamaForCausalLM", hidden_size=1024, intermediate_size=4096,
                              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                              max_position_embeddings=args.prompt_len + 64)
        for cp in (1, 2):
            result["ttft_ms"][f"cp{cp}"] = ttft(big, args.device, args.prompt_len, args.iters, cp)
            print(f"cp={cp}: {result['ttft_ms'][f'cp{cp}']:.1f} ms to first token", flush=True)
    result["prompt_len"] = args.prompt_len
    out = Path(os.environ.get("OUT", ".")) / "context_parallel_gpu.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
