"""How much of a prefill step's device time is gaps between kernels, and would a CUDA graph
remove them?

Takes one real 4096-token prefill forward from the engine (its input ids and context), then
times the same forward three ways on the device, each as CUDA events around every forward:

* eager, back to back: the host launches while the device runs (as in a step);
* eager, host ahead: a ``torch.cuda._sleep`` queued first lets the host queue every forward
  before the device starts, so only the device's own launch gaps remain;
* one CUDA graph of the forward, replayed back to back.

``--side-stream``: instead, eager forwards alternated A/B/A/B with the side stream
(layers/side_stream.py) limited to decode sizes (A, the default) and allowed at this size (B).

    PYTHONPATH=. python3 scripts/probes/prefill_graph_gaps.py --config deepseek-v4-flash \
        --prompt-len 4096 --no-hf
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.bench.args import add_prefill_args
from deepinfer.bench.common import BenchModel, build_engine, random_prompts, step_outputs
from deepinfer.sampling_params import SamplingParams


def timed(run, n: int, sleep_cycles: int = 0) -> tuple[list[float], float]:
    """Device ms of each of ``n`` runs and the host ms to queue them all."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    ev[0].record()
    for i in range(n):
        run()
        ev[i + 1].record()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)], host


def main() -> None:
    p = argparse.ArgumentParser()
    add_prefill_args(p)
    p.add_argument("--side-stream", action="store_true", help="A/B the side stream at prefill instead")
    args = p.parse_args()
    args.argv = []
    model = BenchModel.from_args(args)
    engine = build_engine(model, args, max_num_seqs=2, max_num_batched_tokens=args.prompt_len,
                          max_model_len=args.prompt_len + 1)
    runner = engine.runner
    seen = []
    forward = runner._forward

    def keep(input_ids, ctx):
        seen.append((input_ids, ctx))
        return forward(input_ids, ctx)

    runner._forward = keep
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for prompt in random_prompts(3, args.prompt_len, engine.config.model.vocab_size, gen):
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            step_outputs(engine)
    runner._forward = forward
    input_ids, ctx = seen[-1]
    net = runner.model

    def eager():
        ctx.memo.clear()
        return net(input_ids, ctx)

    with torch.inference_mode():
        for _ in range(3):
            eager()
        n = 6
        if args.side_stream:
            from deepinfer.layers import side_stream
            default, ref = side_stream.MAX_TOKENS, eager().float()
            runs: dict[str, list[float]] = {"decode sizes only": [], "at prefill too": []}
            for _ in range(3):
                for label, limit in (("decode sizes only", default), ("at prefill too", 1 << 30)):
                    side_stream.MAX_TOKENS = limit
                    runs[label].append(statistics.median(timed(eager, n)[0]))
            err = (eager().float() - ref).abs().max().item()
            side_stream.MAX_TOKENS = default
            for label, ms in runs.items():
                print(f"side stream {label}: {statistics.median(ms):.3f} ms/forward ({', '.join(f'{x:.2f}' for x in ms)})")
            print(f"max |B - A| {err:.3g}")
            return
        back, host_back = timed(eager, n)
        ahead, host_ahead = timed(eager, n, sleep_cycles=int(2e9))
        print(f"eager back to back: device {statistics.median(back):.3f} ms/forward "
              f"({', '.join(f'{x:.2f}' for x in back)}); host {host_back / n:.3f} ms/forward to queue")
        print(f"eager host ahead:   device {statistics.median(ahead[1:]):.3f} ms/forward "
              f"({', '.join(f'{x:.2f}' for x in ahead)}); host {host_ahead / n:.3f} ms/forward to queue")
        ref = eager().float()
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            ctx.memo.clear()
            with torch.cuda.graph(graph):
                out = net(input_ids, ctx)
            graph.replay()
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            replay, host_replay = timed(graph.replay, n)
            print(f"graph replay:       device {statistics.median(replay):.3f} ms/forward "
                  f"({', '.join(f'{x:.2f}' for x in replay)}); host {host_replay / n:.3f} ms; "
                  f"max |graph - eager| {err:.3g} (ref max {ref.abs().max().item():.3g})")
        except Exception as exc:  # noqa: BLE001 - a probe: report why capture failed
            print(f"graph capture failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
