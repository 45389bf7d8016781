"""``deepinfer bench throughput``: offline generation throughput, engine vs HF transformers.

Both sides get the same random token-id prompts and generate exactly
``output_len`` tokens each (EOS ignored), greedily, on the same device in the
same process. HF runs ``generate`` over the whole batch with left padding, the
way a user would batch it; the engine runs ``LLM.generate``. Reported: output
tokens/s of each and their ratio. transformers is an optional dependency
(the ``bench`` extra), imported only here.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer.bench.hf_baseline import hf_skip_reason

from deepinfer.entrypoints.llm import DEFAULT_MODEL, LLM
from deepinfer.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_throughput(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    llm = LLM(**engine_kwargs)
    config = llm.engine.config
    device, vocab = config.device, config.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    # Warm-up: the same shapes on other prompts (so no prefix-cache hits later), which
    # also compiles every kernel specialisation the timed run needs.
    warm = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
            for _ in range(args.num_prompts)]
    llm.generate(warm, params, use_tqdm=False)
    _sync(device)
    llm.engine.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    engine_s = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats
    result = {
        "model": engine_kwargs.get("model") or DEFAULT_MODEL, "device": str(device),
        "dtype": str(config.model.dtype), "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "engine_s": engine_s, "engine_output_tok_s": n_out / engine_s,
        "async_scheduling": config.scheduler.async_scheduling,
        "steps": stats.steps, "overlapped_steps": stats.overlapped_steps,
        # CUDA only (None on the CPU): device idle time between consecutive steps.
        "gpu_idle_ms_per_step": stats.gpu_idle_ms_per_step,
        "gpu_busy_ms_per_step": stats.gpu_busy_ms_per_step,
    }
    skip = None if args.no_hf else hf_skip_reason(config.model.hf_config)
    if skip is not None:
        # E.g. the embedded DeepSeek-V4.1: transformers has no such model to compare with.
        result["hf_skipped"] = skip
    elif not args.no_hf:
        del llm
        result.update(_hf_throughput(config.model.path, config.model.dtype, device, prompts,
                                     args.output_len))
        result["ratio_engine_over_hf"] = result["engine_output_tok_s"] / result["hf_output_tok_s"]
    for k, v in result.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    if stats.gpu_idle_ms_per_step is not None:
        overlap = "on" if config.scheduler.async_scheduling else "off"
        print(f"GPU idle between steps: {stats.gpu_idle_ms_per_step:.3f} ms/step (overlap {overlap})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _hf_throughput(path: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
                   output_len: int) -> dict:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the HF baseline needs transformers: pip install 'deepinfer[bench]', "
                          "or pass --no-hf") from exc
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    batch = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    mask = torch.ones_like(batch)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                  pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.randint_like(batch, 0, model.config.vocab_size), attention_mask=mask,
                       **kwargs)  # warm-up on other prompts of the same shape
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=mask, **kwargs)
        _sync(device)
        hf_s = time.perf_counter() - t0
    n_out = (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return {"hf_s": hf_s, "hf_output_tok_s": n_out / hf_s}
