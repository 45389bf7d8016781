"""Command-line options of ``deepinfer bench prefill | decode | curve`` (argparse only, so the
CLI builds its parser without importing torch).

Options left unset take defaults that suit the device (``apply_device_defaults``): on CUDA
the DeepSeek-V4-Flash preset at real widths and real lengths; on the CPU the embedded tiny
model and lengths that keep a run to seconds (a 24 GiB CPU machine holds neither preset).
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_CONFIG = "deepseek-v4-flash"      # on CUDA; the embedded model on the CPU
# --weights, and the engine's ``quantization`` for each (models/quantize.py).
WEIGHT_FORMATS = {"bf16": "none", "fp8": "fp8", "fp8+fp4": "fp8+mxfp4-experts"}

# Per device type: the model, the probes' sizes, and per benchmark its lengths and batches.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"config": DEFAULT_CONFIG, "floor_copy_mib": 2048, "floor_matmul_n": 8192,
             "prefill": {"prompt_len": 4096},
             "decode": {"context_len": 4096},
             "curve": {"context_len": 1024, "batch_sizes": "1,2,4,8,16,32,64,128,256"}},
    "cpu": {"config": None, "floor_copy_mib": 64, "floor_matmul_n": 512,
            "prefill": {"prompt_len": 256},
            "decode": {"context_len": 256},
            "curve": {"context_len": 128, "batch_sizes": "1,2,4,8"}},
}


def apply_device_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Fill the options left unset (None) with ``DEVICE_DEFAULTS`` for ``device_type`` and the
    benchmark ``args.kind``; the CPU's model is the embedded one (``DEFAULT_MODEL``)."""
    table = DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    values = {k: v for k, v in table.items() if not isinstance(v, dict)}
    values.update(table.get(getattr(args, "kind", None), {}))
    if values["config"] is None:
        from deepinfer.entrypoints.llm import DEFAULT_MODEL   # imports torch: only when a benchmark runs
        values["config"] = DEFAULT_MODEL
    for name, value in values.items():
        if getattr(args, name, value) is None:
            setattr(args, name, value)


def add_model_args(p: argparse.ArgumentParser, measured: bool = True) -> None:
    """The model and engine options; ``measured``: also those of the benchmarks that time
    against floors and HF (prefill, decode, curve), which ``bench multiturn`` has no use for."""
    p.add_argument("--config", "--model", dest="config", default=None,
                   help="model shapes: a preset (deepseek-v4-flash, deepseek-v4.1-flash) or a config.json / "
                        "model directory; weights are random, no checkpoint is read (default: "
                        f"{DEFAULT_CONFIG} on CUDA, the embedded tiny model on the CPU). A model whose weights "
                        "and cache do not fit the device's free memory is refused before anything is built")
    p.add_argument("--num-layers", type=int, default=None,
                   help="decoder layers (default: 4 for the preset, the config's own otherwise)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="how the random weights are kept: bf16 (the compute dtype), fp8 (dense projections in "
                        "FP8 with block scales) or fp8+fp4 (and the routed experts in FP4); default: the "
                        "checkpoint's own formats, fp8+fp4 for the DeepSeek presets, as they ship")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the engine's kv_cache_dtype: auto, or fp8 for DeepSeek-V4's FP8 KV records (584 B a "
                        "window row or entry at D = 512; the floors count them so)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, float32 on CPU), float32, bfloat16")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and prompts")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine token budget per step (default: prefill batch x prompt; decode max(4096, B))")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlapped scheduling (default on)")
    p.add_argument("--output-json", default=None, help="write the result as JSON to this path")
    if measured:
        p.add_argument("--warmup", type=int, default=3, help="untimed steps (prefill: rounds) first")
        p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
        p.add_argument("--floor-copy-mib", type=int, default=None,
                       help="size of the bandwidth probe's copy (default: 2048 on CUDA, 64 on the CPU)")
        p.add_argument("--floor-matmul-n", type=int, default=None,
                       help="size of the matmul-rate probe, n^3 (default: 8192 on CUDA, 512 on the CPU)")
        p.add_argument("--batch-invariant", action="store_true",
                       help="also measure the same model in batch-invariant mode, in the same run, and report "
                            "its time against the normal mode's (bench prefill, decode and curve)")


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=None, help="default: 4096 on CUDA, 256 on the CPU")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per round")
    p.add_argument("--iters", type=int, default=5, help="timed rounds after the warm-up")
    p.add_argument("--hf-iters", type=int, default=3, help="timed HF generate calls")
    p.add_argument("--profile", default=None,
                   help="after the timed rounds, profile one round (torch.profiler) and write the kernels "
                        "by device time to this text file, headed by launches and device time in matmuls and "
                        "outside them (with --batch-invariant, that mode's to NAME.batch-invariant.EXT)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallel size: each prompt split over this many ranks (devices); per-GPU "
                        "figures are divided by it")


def _add_decode_common(p: argparse.ArgumentParser, kind: str, steps: int) -> None:
    add_model_args(p)
    cuda, cpu = DEVICE_DEFAULTS["cuda"][kind]["context_len"], DEVICE_DEFAULTS["cpu"][kind]["context_len"]
    p.add_argument("--context-len", type=int, default=None,
                   help=f"prompt tokens of each request (default: {cuda} on CUDA, {cpu} on the CPU)")
    p.add_argument("--steps", type=int, default=steps, help="timed decode steps")
    p.add_argument("--hf-steps", type=int, default=8,
                   help="extra decode steps of the HF baseline's longer generate")
    p.add_argument("--speculative", type=int, default=0, metavar="N",
                   help="also measure each point with speculative decoding of N draft tokens a step, on the "
                        "same engine, reported apart from the run without it (default 0: off)")
    p.add_argument("--spec-method", choices=("fixed", "ngram", "dspark"), default="fixed",
                   help="drafter of --speculative: fixed (N drafts every step, so every step verifies 1 + N "
                        "tokens per request: the cost of a verification step), ngram (the engine's prompt "
                        "lookup) or dspark (a DeepSeek-V4.1 config's DSpark module at the release's shapes, "
                        "random weights: the drafter's cost is in every step); the weights are random, so "
                        "measured acceptance is not meaningful")
    p.add_argument("--drafter-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="--spec-method dspark: its decode and verification steps replay CUDA graphs (the "
                        "target's forward with the drafter's features, and the proposal); --no-drafter-graphs "
                        "runs them eagerly (speculative_config cuda_graphs)")
    p.add_argument("--assumed-nextn", type=int, default=3,
                   help="the assumed-acceptance figure's draft tokens; it needs --speculative equal to it")
    p.add_argument("--assumed-acceptance", type=float, default=0.75,
                   help="the assumed-acceptance figure's per-draft acceptance: tau = 1 + nextn x acceptance")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    _add_decode_common(p, "decode", steps=32)
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests")
    p.add_argument("--profile", default=None,
                   help="after the timed window, profile a few decode steps (torch.profiler) and write "
                        "the kernels by device time to this text file, headed by launches and device time in "
                        "matmuls and outside them (with --batch-invariant, that mode's to NAME.batch-invariant.EXT)")
    p.add_argument("--compare-sync", action=argparse.BooleanOptionalAction, default=True,
                   help="after the timed window, time as many steps again with overlapped scheduling "
                        "off, to report the GPU idle time between steps without it")


def add_curve_args(p: argparse.ArgumentParser) -> None:
    _add_decode_common(p, "curve", steps=16)
    p.add_argument("--batch-sizes", default=None,
                   help=f"comma-separated batch sizes (default: {DEVICE_DEFAULTS['cuda']['curve']['batch_sizes']} "
                        f"on CUDA, {DEVICE_DEFAULTS['cpu']['curve']['batch_sizes']} on the CPU)")
    p.add_argument("--output-png", default=None,
                   help="plot path (default: the --output-json path with .png, when given)")


def add_multiturn_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, measured=False)
    p.add_argument("--system-len", type=int, default=2000, help="tokens of the shared system prompt")
    p.add_argument("--conversations", type=int, default=64, help="conversations, all open at once")
    p.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    p.add_argument("--question-len", type=int, default=64, help="tokens of each user question")
    p.add_argument("--answer-len", type=int, default=64, help="tokens of each answer (EOS ignored)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size (prefix-hit granularity)")
    p.add_argument("--settings", default="on,off",
                   help="settings to run, in order: on, off (prefix caching), host (plus the host tier), "
                        "disk (plus the disk tier, after a restart)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="device KV-cache blocks (default: the budget's); small, so that blocks are evicted")
    p.add_argument("--kv-offload-gib", type=float, default=1.0, help="host tier of the 'host' setting (GiB)")
    p.add_argument("--kv-disk-dir", default=None,
                   help="disk tier directory of the 'disk' setting (default: a new temporary directory)")
    p.add_argument("--kv-disk-gib", type=float, default=4.0, help="disk tier of the 'disk' setting (GiB)")
    p.add_argument("--warmup-conversations", type=int, default=None,
                   help="whole conversations run untimed first (default: all of them on a GPU, 4 on the CPU)")
