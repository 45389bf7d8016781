"""Prefill/decode disaggregation's engine side on CUDA: a prompt's KV blocks read from one
engine's device cache (``read_kv_block``) and put into another's pinned host tier
(``KVTierStore.put_host``), then loaded back on the side stream by the decode engine's prefix
lookup. On the embedded DeepSeek-V4.1 model (its packed KV records on CUDA) and the tiny
DeepSeek-V4: the decode engine's greedy tokens must equal a single engine's and its logprobs
be within 5e-5 (bf16 runs report the agreement): the decode engine computes the prompt's last
partial block as a short prefill after the hit, whose GPU kernels sum in another order than the
single engine's whole-prompt prefill (float32 on an H100: up to 2e-5). Then the same hand-over through CUDA IPC
(engine/kv_share.py): the prefill engine stages the blocks on its GPU, a decode engine in
another process maps the buffer from the handle alone, and after the release the prefill
process's allocated memory is back where it was. Exit status 1 on a failure; the last line
says OK or FAILED."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import kv_transfer
from deepinfer.engine.kv_share import ShareRegistry

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)
FLOAT32_LOGPROB_TOL = 5e-5


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
        ok &= same == len(want) and diff <= FLOAT32_LOGPROB_TOL
    print(f"{name} {dtype}: {len(blob)} bytes, {result.imported} blocks, hits {export.num_tokens}, "
          f"greedy equal {same}/{len(want)}, max |dlogprob| {diff:.2e}, host hits {decode.engine.kv.tier_hits}: "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def engine_kwargs(model: str | None, dtype: str) -> dict:
    return dict(device="cuda", dtype=dtype, num_kv_blocks=256, **({"model": model} if model else {}))


def decode_in_this_process(blob_path: str, model: str | None, dtype: str) -> None:
    """The decode side of :func:`check_shared`, in its own process: import, generate, print JSON."""
    decode = LLM(kv_offload_gib=0.05, **engine_kwargs(model, dtype))
    result = kv_transfer.import_blocks(decode.engine, kv_transfer.decode(Path(blob_path).read_bytes()))
    got = decode.generate(prompts(), PARAMS, use_tqdm=False)
    print(json.dumps({"imported": result.imported, "opened": result.opened, "bytes": result.nbytes,
                      "tokens": [g.outputs[0].token_ids for g in got],
                      "logprobs": [[lp[t].logprob for t, lp in zip(g.outputs[0].token_ids, g.outputs[0].logprobs)]
                                   for g in got],
                      "cached": [g.num_cached_tokens for g in got]}))


def check_shared(name: str, model: str | None, dtype: str) -> bool:
    kw = engine_kwargs(model, dtype)
    single = LLM(enable_prefix_caching=False, **kw)
    want = single.generate(prompts(), PARAMS, use_tqdm=False)
    del single
    prefill = LLM(**kw)
    prefill.generate(prompts(), PREFILL, use_tqdm=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    shares = ShareRegistry()
    export = kv_transfer.export_prompts(prefill.engine, prompts(), shares)
    staged = torch.cuda.memory_allocated() - before
    with tempfile.NamedTemporaryFile(suffix=".kv") as f:
        f.write(kv_transfer.encode(export))
        f.flush()
        proc = subprocess.run([sys.executable, __file__, "--decode-from", f.name, "--model", model or "",
                               "--dtype", dtype], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(f"{name} {dtype} shared: decode process failed:\n{proc.stderr[-3000:]}", flush=True)
        return False
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    shares.release(export.share["id"], opened=got["opened"])
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    after = torch.cuda.memory_allocated()
    # A buffer nobody opened: released with its opener's count, it is freed at once.
    unopened = kv_transfer.export_prompts(prefill.engine, prompts(), shares)
    shares.release(unopened.share["id"], opened=False)
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    after_unopened = torch.cuda.memory_allocated()
    same = sum(g == w.outputs[0].token_ids for g, w in zip(got["tokens"], want))
    diff = max((abs(a - w.outputs[0].logprobs[i][t].logprob)
                for g, lp, w in zip(got["tokens"], got["logprobs"], want)
                for i, (t, a) in enumerate(zip(g, lp)) if t == w.outputs[0].token_ids[i]), default=0.0)
    ok = (got["opened"] and got["imported"] == len(export.blocks) > 0 and got["cached"] == export.num_tokens
          and after == before == after_unopened and staged >= got["bytes"])
    if dtype == "float32":
        ok &= same == len(want) and diff <= FLOAT32_LOGPROB_TOL
    print(f"{name} {dtype} shared (CUDA IPC, decode in another process): staged {got['bytes']} bytes "
          f"({staged} allocated), {got['imported']} blocks, cached {got['cached']}, greedy equal {same}/{len(want)}, "
          f"max |dlogprob| {diff:.2e}, allocated after release {after - before:+d} bytes "
          f"(unopened buffer: {after_unopened - before:+d}): "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main() -> int:
    if "--decode-from" in sys.argv:
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        decode_in_this_process(args["--decode-from"], args["--model"] or None, args["--dtype"])
        return 0
    ok = True
    for name, model in (("v4.1", None), ("v4", str(REPO / "tests/data/tiny-v4-model"))):
        for dtype in ("float32", "bfloat16"):
            ok &= check(name, model, dtype)
        ok &= check_shared(name, model, "float32")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
