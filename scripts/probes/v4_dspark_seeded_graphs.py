"""Why the tiny DeepSeek-V4 DSpark engine's seeded sampled tokens with CUDA graphs differ from
eager ones (tests/gpu/test_drafter_graphs.py::test_v4_dspark_graphs_match_eager_float32[seeded]):
the same requests on float32 CUDA engines (eager / graphs, with / without DSpark, and graphs for
the target only), each
request's tokens with the sampled token's logprob and the top two, then for every engine the
first position where its tokens leave the eager DSpark engine's, with both engines' logprobs
there and the largest logprob difference before it. A flip at a near tie after growing
logprob differences is kernel noise amplified by a random model; a flip with equal logprobs
before it is a bug in the graph path.

    python scripts/probes/v4_dspark_seeded_graphs.py          # on a GPU, ~1 minute
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from tests.gpu.test_drafter_graphs import MAX_TOKENS, SIZES, seeded
from tests.models.v4_dspark_checkpoint import BLOCK, write_bigram_checkpoint_for
from tests.models.v4_dspark_checkpoint import PROMPTS as V4_PROMPTS

DEVICE = os.environ.get("PROBE_DEVICE", "cuda")   # "cpu": a dry run (no graphs)


def with_logprobs(params: list[SamplingParams]) -> list[SamplingParams]:
    for p in params:
        p.logprobs = 2
    return params


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def run(model: str, spec: dict | None, eager: bool, env: dict[str, str] | None = None
        ) -> list[tuple[list[int], list[dict]]]:
    kwargs = dict(enforce_eager=True) if eager else dict(cuda_graph_sizes=SIZES)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        llm = LLM(model=model, device=DEVICE, dtype="float32", max_num_seqs=8, max_num_batched_tokens=160,
                  block_size=4, num_kv_blocks=600, speculative_config=spec, **kwargs)
        outs = llm.generate(V4_PROMPTS, with_logprobs(seeded()), use_tqdm=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # Drafts and acceptance: equal counts with different logprobs mean the same verification
    # layout computed differently (a fault), different counts a different layout.
    counts = {m.name.split(":")[-1]: getattr(m, "value", None) for m in llm.get_metrics()
              if any(m.name.endswith(c) for c in SPEC_COUNTERS)}
    if counts:
        print(f"   ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})", flush=True)
    del llm
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def main() -> None:
    model = str(write_bigram_checkpoint_for(Path(tempfile.mkdtemp()), V4_PROMPTS, MAX_TOKENS))
    spec = {"method": "dspark", "num_speculative_tokens": BLOCK}
    runs = {}
    for name, s, eager, env in (("dspark eager", spec, True, None), ("dspark graphs", spec, False, None),
                                ("dspark graphs, drafter eager", {**spec, "cuda_graphs": False}, False, None),
                                ("dspark graphs, PDL off", spec, False, {"DEEPINFER_PDL": "0"}),
                                ("dspark graphs, no side stream", spec, False, {"DEEPINFER_SIDE_STREAM": "0"}),
                                ("plain eager", None, True, None), ("plain graphs", None, False, None)):
        print(f"-- {name}", flush=True)
        runs[name] = run(model, s, eager, env)
    ref = runs["dspark eager"]
    for name, got in runs.items():
        print(f"== {name}")
        for i, ((toks, lps), (rtoks, rlps)) in enumerate(zip(got, ref)):
            n = next((j for j, (a, b) in enumerate(zip(toks, rtoks)) if a != b), None)
            upto = len(toks) if n is None else n
            drift = max((abs(lps[j][toks[j]].logprob - rlps[j][rtoks[j]].logprob) for j in range(upto)),
                        default=0.0)
            if n is None:
                print(f"  request {i}: equal ({len(toks)} tokens), max logprob diff {drift:.2e}")
                continue
            top = lambda d: sorted(((t, round(l.logprob, 5)) for t, l in d.items()), key=lambda x: -x[1])[:3]
            print(f"  request {i}: differs at {n}: {toks[n]} vs {rtoks[n]}; max logprob diff before {drift:.2e}; "
                  f"this {top(lps[n])} ref {top(rlps[n])}")


if __name__ == "__main__":
    main()
