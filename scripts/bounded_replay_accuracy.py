"""SWA bounded replay against the full prefill, on a DeepSeek-V4.1 checkpoint.

For each of ``--num-prompts`` prompts longer than the keep length (seeded random token ids,
or the lines of ``--text`` when given), greedy-decodes ``--max-tokens`` tokens with
prefill truncation ``full``, ``exact`` and ``compact`` (keep ``--keep``) and reports:

- exact vs full: prompts whose tokens are identical, and the largest logprob difference
  of the generated tokens (equal up to float rounding by construction);
- compact vs full: greedy agreement (prompts identical over all tokens, and the mean first
  divergence), and at each decode position j, while both runs still agree, the largest
  difference of the top-20 logprobs (the engine returns at most 20 per position; over the
  tokens both runs list) — the logits' difference up to each row's log-normaliser.

Run:  python scripts/bounded_replay_accuracy.py --model DIR [--keep N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from deepinfer import LLM, SamplingParams


def top_logprobs(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    result = []
    for o in outputs:
        c = o.outputs[0]
        result.append((c.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in c.logprobs]))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--keep", type=int, default=140, help="compact mode's keep length")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=None, help="default: 2 x keep")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="float32")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    length = args.prompt_len or 2 * args.keep
    if length <= args.keep:
        p.error(f"--prompt-len={length} must exceed --keep={args.keep}: shorter prompts are not truncated")

    runs, vocab = {}, None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=20)
    for mode in ("full", "exact", "compact"):
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  yoco_prefill_truncation_mode=mode, yoco_prefill_keep_tokens=args.keep,
                  enable_prefix_caching=False)
        if vocab is None:
            vocab = int(llm.engine.config.model.vocab_size)
            g = np.random.default_rng(0)
            prompts = [g.integers(3, vocab, size=length).tolist() for _ in range(args.num_prompts)]
        t = time.perf_counter()
        runs[mode] = top_logprobs(llm.generate(prompts, params, use_tqdm=False))
        print(f"{mode}: {time.perf_counter() - t:.1f} s", flush=True)
        del llm

    exact_same = sum(e[0] == f[0] for e, f in zip(runs["exact"], runs["full"]))
    exact_diff = max((abs(e[1][j][t] - f[1][j][t]) for e, f in zip(runs["exact"], runs["full"]) if e[0] == f[0]
                      for j, t in enumerate(f[0])), default=0.0)
    per_position = [0.0] * args.max_tokens
    agree, first_div = 0, []
    for c, f in zip(runs["compact"], runs["full"]):
        j = 0
        while j < args.max_tokens:
            common = c[1][j].keys() & f[1][j].keys()
            per_position[j] = max(per_position[j], max(abs(c[1][j][t] - f[1][j][t]) for t in common))
            if c[0][j] != f[0][j]:
                break
            j += 1
        agree += j == args.max_tokens
        first_div.append(j)
    report = {
        "model": args.model, "prompts": args.num_prompts, "prompt_len": length, "keep": args.keep,
        "max_tokens": args.max_tokens,
        "exact_identical_prompts": exact_same, "exact_max_logprob_diff": exact_diff,
        "compact_identical_prompts": agree, "compact_mean_first_divergence": float(np.mean(first_div)),
        "compact_max_top20_logprob_diff_by_position": per_position,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if exact_same == args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
