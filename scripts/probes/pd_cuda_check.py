"""Prefill/decode disaggregation's engine side on CUDA: a prompt's KV blocks read from one
engine's device cache (``read_kv_block``) and put into another's pinned host tier
(``KVTierStore.put_host``), then loaded back on the side stream by the decode engine's prefix
lookup. On the embedded DeepSeek-V4.1 model (its packed KV records on CUDA) and the tiny
DeepSeek-V4: the decode engine's greedy tokens must equal a single engine's and its logprobs
be within 1e-5 (bf16 runs report the agreement). Exit status 1 on a failure; the last line
says OK or FAILED."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import kv_transfer

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (300, 77, 1000)]


def check(name: str, model: str | None, dtype: str) -> bool:
    kw = dict(device="cuda", dtype=dtype, num_kv_blocks=256, **({"model": model} if model else {}))
    single = LLM(enable_prefix_caching=False, **kw)
    want = single.generate(prompts(), PARAMS, use_tqdm=False)
    del single
    prefill = LLM(**kw)
    prefill.generate(prompts(), PREFILL, use_tqdm=False)
    export = kv_transfer.export_prompts(prefill.engine, prompts())
    blob = kv_transfer.encode(export)
    del prefill
    decode = LLM(kv_offload_gib=0.05, **kw)
    result = kv_transfer.import_blocks(decode.engine, kv_transfer.decode(blob))
    got = decode.generate(prompts(), PARAMS, use_tqdm=False)
    ok = result.imported == len(export.blocks) > 0
    same = diff = 0
    for g, w, hit in zip(got, want, export.num_tokens):
        ok &= g.num_cached_tokens == hit
        same += g.outputs[0].token_ids == w.outputs[0].token_ids
        for tok, lg, lw in zip(g.outputs[0].token_ids, g.outputs[0].logprobs, w.outputs[0].logprobs):
            if tok in lg and tok in lw:
                diff = max(diff, abs(lg[tok].logprob - lw[tok].logprob))
    exact = dtype == "float32"
    if exact:
        ok &= same == len(want) and diff <= 1e-5
    print(f"{name} {dtype}: {len(blob)} bytes, {result.imported} blocks, hits {export.num_tokens}, "
          f"greedy equal {same}/{len(want)}, max |dlogprob| {diff:.2e}, host hits {decode.engine.kv.tier_hits}: "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main() -> int:
    ok = True
    for name, model in (("v4.1", None), ("v4", str(REPO / "tests/data/tiny-v4-model"))):
        for dtype in ("float32", "bfloat16"):
            ok &= check(name, model, dtype)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
