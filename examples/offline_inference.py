"""Offline batch inference with deepinfer.

    python examples/offline_inference.py                       # embedded tiny model
    python examples/offline_inference.py --model /path/to/ckpt --ep 8 --dp 8

The parallelism flags follow DeepSeek's release (--ep, --dp, --cp) plus --tp. --tp, --ep and
--dp/--cp start one worker process per rank (CUDA devices, or the CPU with --device cpu); the
resolved rank layout is printed first. With --dp each data-parallel rank runs its own requests'
attention, the experts are split over --ep ranks; --cp splits each long prefill over its ranks
(every rank keeps the whole KV cache).
"""

import argparse

from deepinfer import LLM, SamplingParams
from deepinfer.config import ParallelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--dp", type=int, default=1, help="data parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()

    parallel = ParallelConfig(tp=args.tp, ep=args.ep, dp=args.dp, cp=args.cp)
    print(f"rank layout: {parallel.describe()}")
    llm = LLM(model=args.model, device=args.device, tensor_parallel_size=args.tp, expert_parallel_size=args.ep,
              data_parallel_size=args.dp, context_parallel_size=args.cp)
    print(llm.engine.config.parallel.describe())
    prompts = [
        "The meaning of a module is",
        "Return the number of",
        "This function takes",
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    chat = llm.chat([{"role": "user", "content": "What does the list type do?"}], params, use_tqdm=False)
    print(f"chat -> {chat[0].outputs[0].text!r}")
    llm.close()


if __name__ == "__main__":
    main()
