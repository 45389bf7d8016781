"""Command line: ``deepinfer generate | serve | router | bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from deepinfer import env
from deepinfer.bench import args as bench_args
from deepinfer.bench.serve import args as serve_bench_args
from deepinfer.entrypoints.openai.reasoning import REASONING_PARSERS
from deepinfer.entrypoints.openai.tool_parsers import TOOL_CALL_FORMATS as TOOL_CALL_PARSERS
from deepinfer.router import server as router_server
from deepinfer.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add_kv_tier_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlapped scheduling: plan the next step while the device runs this one "
                        "(default on; --no-async-scheduling for one step at a time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--eplb", action="store_true",
                   help="expert load balancing while serving: experts are placed anew every --eplb-interval "
                        "steps for the load of the last --eplb-window steps (needs --ep > 1)")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="extra expert slots per MoE layer for replicas of busy experts (with --eplb)")
    p.add_argument("--eplb-window", type=int, default=1000, help="engine steps of expert load EPLB places for")
    p.add_argument("--eplb-interval", type=int, default=3000, help="engine steps between EPLB rebalances")
    p.add_argument("--dp", type=int, default=1, help="data parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (no CUDA graphs)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes to capture in CUDA graphs (default: 1 2 4 8 16 ... up to "
                        "min(max-num-seqs, 256))")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's own KV format; DeepSeek-V4.1: the release's rounded records), "
                        "fp8 (DeepSeek-V4: DeepSeek's FP8 KV records, 584 B a row instead of 1,024), "
                        "or unrounded bfloat16 / float32 where the model offers them")
    p.add_argument("--quantization", default=None,
                   help="how the weights are kept: auto (default: the checkpoint's own formats, FP8/FP4 as "
                        "shipped on CUDA, dequantised on the CPU), none, fp8, mxfp4-experts, fp8+mxfp4-experts")
    p.add_argument("--yoco-prefill-truncation-mode", choices=env.PREFILL_TRUNCATION_MODES,
                   default=None,
                   help="bounded replay of prompts: the layers after the last KV-source layer run on "
                        "each prompt's last tokens only (DeepSeek-V4.1); default: "
                        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE, else full")
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="batch-invariant mode: a request's tokens and logprobs are bitwise the same "
                        "whatever shares its batch and however its prompt is chunked (CPU only for now); "
                        "default: DEEPINFER_BATCH_INVARIANT, else off")
    p.add_argument("--speculative-config", type=_json_dict, default=None,
                   help="speculative decoding, as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (methods: ngram, dspark, mtp; num_speculative_tokens "
                        "defaults to DEEPINFER_USE_NEXTN_DECODE, else 5)")
    p.add_argument("--yoco-prefill-keep-tokens", type=int, default=None,
                   help="trailing prompt tokens bounded replay keeps for the late layers; default: "
                        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS, else 140")


def add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="host memory (GiB) for prefix-cache blocks evicted from the KV cache (default 0: none)")
    p.add_argument("--kv-disk-dir", default=None,
                   help="directory of the disk tier below host memory, found again after a restart")
    p.add_argument("--kv-disk-gib", type=float, default=0.0, help="size of the disk tier (GiB)")


def _json_dict(text: str) -> dict:
    """A command-line JSON object (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_offload_gib=args.kv_offload_gib, kv_disk_dir=args.kv_disk_dir, kv_disk_gib=args.kv_disk_gib,
                async_scheduling=args.async_scheduling, seed=args.seed,
                tensor_parallel_size=args.tp, expert_parallel_size=args.ep,
                enable_eplb=args.eplb, num_redundant_experts=args.num_redundant_experts,
                eplb_window_size=args.eplb_window, eplb_step_interval=args.eplb_interval,
                data_parallel_size=args.dp, context_parallel_size=args.cp,
                enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                yoco_prefill_truncation_mode=args.yoco_prefill_truncation_mode,
                yoco_prefill_keep_tokens=args.yoco_prefill_keep_tokens,
                batch_invariant=args.batch_invariant, speculative_config=args.speculative_config)


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.request_seed)
    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    for prompt in args.prompt:
        rid = engine.add_request(prompt, params)
        sys.stdout.write(prompt)
        finished = False
        while not finished:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if out.error:
                    print(f"\nerror: {out.error}", file=sys.stderr)
                    return 1
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                finished = out.finished
        sys.stdout.write("\n")
    llm.close()      # a disk tier keeps the cache for the next run
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        if args.role is not None:
            raise ValueError("--role and --replicas: start prefill and decode instances separately and put "
                             "`deepinfer router --prefill ... --decode ...` in front of them")
        return router_server.run_replicas(args)
    from deepinfer.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    return router_server.run_router(args)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from deepinfer.bench.throughput import run_throughput

    run_throughput(args, engine_kwargs(args))
    return 0


def cmd_bench_prefill(args: argparse.Namespace) -> int:
    from deepinfer.bench.prefill import run_prefill

    run_prefill(args)
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from deepinfer.bench.decode import run_decode

    run_decode(args)
    return 0


def cmd_bench_curve(args: argparse.Namespace) -> int:
    from deepinfer.bench.curve import run_curve

    run_curve(args)
    return 0


def cmd_bench_multiturn(args: argparse.Namespace) -> int:
    from deepinfer.bench.multiturn import run_multiturn

    run_multiturn(args)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from deepinfer.bench.serve.runner import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route except /health")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) clients use; the first is reported (default: the --model value)")
    srv.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                     help="the format the model writes tool calls in (DeepSeek-V3: deepseek_v3, V3.1: "
                          "deepseek_v31, V3.2: deepseek_v32, V4: deepseek_v4, V4.1: deepseek_v41); tool_choice "
                          "required/named force it (default: the model's own by config.json's model_type, "
                          "deepseek_v3 for other models)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    srv.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                     help="split a thinking model's reasoning into reasoning_content: deepseek_v3 when "
                          'chat_template_kwargs {"thinking": true} asks for it, deepseek_r1 always')
    srv.add_argument("--replicas", type=int, default=1,
                     help="data-parallel replicas: N engines, each its own process on a free local port, behind "
                          "the router (deepinfer router) on --host/--port; the --router-* options set its policy")
    srv.add_argument("--role", choices=("prefill", "decode"), default=None,
                     help="prefill/decode disaggregation behind `deepinfer router --prefill ... --decode ...`: "
                          "prefill computes prompts and answers their KV blocks (/kv/prefill/...); decode imports "
                          "them into its host tier (/kv/import, needs --kv-offload-gib) and generates")
    router_server.add_policy_args(srv, prefix="router-")
    srv.set_defaults(func=cmd_serve)

    rtr = sub.add_parser("router", help="route OpenAI requests over replicas by prefix-cache affinity and load",
                         description="An OpenAI-compatible proxy in front of deepinfer serve replicas (or any "
                                     "OpenAI-compatible servers): cache-aware routing, health checks, retries, "
                                     "its own /metrics")
    router_server.add_router_args(rtr)
    rtr.set_defaults(func=cmd_router)

    bench = sub.add_parser("bench", help="benchmarks (results go to docs/BENCHMARKS.md by hand)")
    kinds = bench.add_subparsers(dest="kind", required=True)
    tput = kinds.add_parser("throughput", help="offline generation throughput of a checkpoint, engine vs HF")
    add_engine_args(tput)
    tput.add_argument("--num-prompts", type=int, default=32)
    tput.add_argument("--input-len", type=int, default=64)
    tput.add_argument("--output-len", type=int, default=64)
    tput.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    tput.add_argument("--json", default=None, help="write the result as JSON to this path")
    tput.set_defaults(func=cmd_bench_throughput)
    for name, add_args, func, text in (
            ("prefill", bench_args.add_prefill_args, cmd_bench_prefill,
             "input tokens/s/GPU of a prompt on random weights at real widths, floor and HF beside it"),
            ("decode", bench_args.add_decode_args, cmd_bench_decode,
             "decode steps/s at batch B and context L on random weights, floor and HF beside it"),
            ("curve", bench_args.add_curve_args, cmd_bench_curve,
             "decode over batch sizes: throughput per GPU vs per-user tokens/s, JSON and PNG"),
            ("multiturn", bench_args.add_multiturn_args, cmd_bench_multiturn,
             "multi-turn chat (shared system prompt) with prefix caching on and off: hit rate and TTFT"),
            ("serve", serve_bench_args.add_serve_args, cmd_bench_serve,
             "online serving benchmark of a running OpenAI-compatible server (ours, vLLM, SGLang): "
             "TTFT, TPOT, ITL, E2EL, throughput and goodput, as vllm bench serve reports them")):
        kind = kinds.add_parser(name, help=text, description=text)
        add_args(kind)
        kind.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv          # benchmarks record the command they ran
    logging.basicConfig(level=args.log_level.upper())
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
