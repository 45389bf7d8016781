"""What ``deepinfer bench prefill | decode | curve`` share: the model under test and its
accounting, the engine built on random weights, the measured floors, routing counts,
the report (the command-line options are in bench/args.py).

Each benchmark runs in one process: the fit check (bench/fit.py: a model the device
cannot hold is refused before anything is allocated), floors (on an empty device), then
the engine, then (after the engine is freed) the HF transformers baseline on the same
random weights (bench/hf_baseline.py).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer import env
from deepinfer.bench.args import apply_device_defaults
from deepinfer.bench.fit import check_fits
from deepinfer.bench.floors import (DeepseekCost, DeepseekV4Cost, DeepseekV41Cost, measure_hbm_bandwidth,
                                    measure_matmul_tflops)
from deepinfer.bench.args import WEIGHT_FORMATS
from deepinfer.bench.model_shapes import SHIPPED_QUANTIZATION, V4_ARCH, V41_ARCH, resolve_config, with_dspark
from deepinfer.config import resolve_dtype
from deepinfer.engine.engine import Engine, freeze_heap
from deepinfer.entrypoints.llm import build_engine_config, resolve_device

# The CPU KV-cache budget the benchmark engines get (build_engine_config's default), which
# the engine allocates whole.
CPU_KV_CACHE_BYTES = 1 << 30
from deepinfer.forward_context import ForwardContext
from deepinfer.layers.deepseek_v4_moe import DeepseekV4Router
from deepinfer.models.deepseek_v4 import DeepseekV4Args
from deepinfer.models.deepseek_v41 import DeepseekV41Args
from deepinfer.outputs import RequestOutput

# Speculative tokens per step of the plain decode measurement (the header's ``nextn``): it
# commits at most one token per request a step. ``--speculative N`` is reported apart
# (bench/speculative.py), with nextn = N.
NEXTN = 0
# Context-parallel ranks of the decode benchmarks: they run on one device (``bench prefill
# --cp N`` runs N ranks and divides its per-GPU figures by N).
CP = 1


def model_cost(hf_config: dict[str, Any], weight_bytes: int, cache_bytes: int,
               kv_cache_dtype: str = "auto") -> DeepseekCost:
    """The byte/FLOP accounting of ``hf_config``'s architecture (bench/floors.py); V4's KV rows
    at their FP8 record size with ``kv_cache_dtype="fp8"``."""
    arch = (hf_config.get("architectures") or ["<none>"])[0]
    if arch == V4_ARCH:
        return DeepseekV4Cost(DeepseekV4Args.from_hf(hf_config), weight_bytes, cache_bytes,
                              bool(hf_config.get("tie_word_embeddings", False)), kv_cache_dtype=kv_cache_dtype)
    if arch == V41_ARCH:
        return DeepseekV41Cost(DeepseekV41Args.from_hf(hf_config), weight_bytes, cache_bytes)
    raise NotImplementedError(f"bench prefill/decode/curve account bytes and FLOPs for {V4_ARCH} and "
                              f"{V41_ARCH} only; the config is {arch}")


# The cost table's names of the projections models/quantize.py keeps in FP8 (with the shared experts).
_FP8_COST_NAMES = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "indexer.q_b_proj")


@dataclass
class BenchModel:
    """The model under test: its config, where it runs, how its weights are kept
    (``quantization``, with the release's ``quantization_config`` for the presets), and its
    byte/FLOP accounting (weights counted as stored; ``load_bytes``: the 16-bit weights the
    model is built with before quantising, what must fit)."""

    label: str
    hf_config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    cost: DeepseekCost
    quantization: str = "auto"
    quant_config: dict[str, Any] | None = None
    weights: str = "bf16"
    load_bytes: int = 0
    kv_cache_dtype: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchModel:
        """The model of ``args.config`` on ``args.device``; options left unset take the
        device's defaults first (``apply_device_defaults``, which updates ``args``)."""
        from deepinfer.models.quantize import plan_for
        device = resolve_device(args.device)
        apply_device_defaults(args, device.type)
        label, hf_config = resolve_config(args.config, args.num_layers)
        if getattr(args, "speculative", 0) and getattr(args, "spec_method", None) == "dspark":
            hf_config = with_dspark(hf_config)
            label += " + DSpark drafter"
        dtype = resolve_dtype(args.dtype, device)
        elem = torch.empty((), dtype=dtype).element_size()
        weights = getattr(args, "weights", None) or ("fp8+fp4" if args.config in SHIPPED_QUANTIZATION else None)
        quantization = WEIGHT_FORMATS[weights] if weights else "auto"
        quant_config = SHIPPED_QUANTIZATION.get(args.config) or hf_config.get("quantization_config")
        kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
        cost = model_cost(hf_config, elem, elem, kv_cache_dtype)
        load_bytes = cost.param_bytes
        plan = plan_for({**hf_config, "quantization_config": quant_config}, quantization, device)
        if plan is not None:
            scale = 4 if plan.scale_format == "float32" else 1
            expert_scale = 4 if plan.expert_scale_format == "float32" else 1
            cost.with_weight_formats(_FP8_COST_NAMES, 1 + scale / (plan.block[0] * plan.block[1]) if plan.fp8 else None,
                                     0.5 + expert_scale / 32 if plan.fp4_experts else None)
        return cls(label, hf_config, device, dtype, cost, quantization, quant_config,
                   plan.label if plan is not None else str(dtype).replace("torch.", ""), load_bytes,
                   kv_cache_dtype)

    def engine_hf_config(self) -> dict[str, Any]:
        """The config the engine is built from: with the release's quantization_config for a preset."""
        if self.quant_config is None:
            return self.hf_config
        return {**self.hf_config, "quantization_config": self.quant_config}

    def check_fits(self, kv_tokens: int, free: int | None = None) -> dict[str, int]:
        """ValueError, before anything is allocated, when the weights (in 16 bits: the model is
        built so before it is quantised) plus the KV cache of ``kv_tokens`` tokens (and a margin)
        exceed the device's free memory (bench/fit.py)."""
        return check_fits(self.label, self.device, max(self.load_bytes, self.cost.param_bytes),
                          int(kv_tokens * self.cost.kv_write_bytes()), CPU_KV_CACHE_BYTES, free)

    def describe(self) -> dict[str, Any]:
        # layer_types: V4's attention types; V4.1's roles (window, source, reindex, reuse).
        return {"model": self.label, "num_layers": self.cost.num_layers,
                "layer_types": self.cost.layer_kinds(),
                "params": self.cost.num_params, "param_bytes": self.cost.param_bytes,
                "weights": self.weights, "quantization": self.quantization,
                "kv_cache_dtype": self.kv_cache_dtype, "device": device_name(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "torch": torch.__version__}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_floors(model: BenchModel, args: argparse.Namespace) -> dict[str, float]:
    """HBM copy bandwidth and dense matmul rate of this device, measured now."""
    hbm = measure_hbm_bandwidth(model.device, args.floor_copy_mib << 20)
    mm = measure_matmul_tflops(model.device, args.floor_matmul_n, model.dtype)
    free_memory(model.device)
    return {"hbm_gb_s": hbm, "matmul_tflop_s": mm, "copy_bytes": args.floor_copy_mib << 20,
            "matmul_n": args.floor_matmul_n}


def build_engine(model: BenchModel, args: argparse.Namespace, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, **settings: Any) -> Engine:
    """An engine over ``model``'s shapes with random weights and no tokenizer (``settings``:
    further engine arguments); fails clearly if the random weights give non-finite
    activations."""
    config = build_engine_config(
        model.label, hf_config=model.engine_hf_config(), load_format="dummy", skip_tokenizer_init=True,
        quantization=model.quantization, kv_cache_dtype=model.kv_cache_dtype,
        dtype=model.dtype, device=str(model.device), seed=args.seed, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, **{"cpu_kv_cache_bytes": CPU_KV_CACHE_BYTES, **settings})
    engine = Engine(config)
    if engine.model is not None:
        # (Several ranks: the model lives in the worker processes, unchecked here.)
        check_finite(engine.model, model.device, int(model.hf_config["vocab_size"]), args.seed)
    freeze_heap()   # no full-collection pauses inside timed windows; free_memory unfreezes
    return engine


@torch.inference_mode()
def check_finite(model: torch.nn.Module, device: torch.device, vocab_size: int, seed: int,
                 num_tokens: int = 32) -> None:
    """Run ``num_tokens`` random tokens through the model (no cache) and raise RuntimeError
    naming the first decoder layer whose output is not finite, or the logits."""
    layers = [(n, m) for n, m in model.named_modules() if n.count(".") == 2 and n.startswith("model.layers.")]
    finite: list[tuple[str, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out, n=n: finite.append((n, _all_finite(out))))
             for n, m in layers]
    try:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (num_tokens,), generator=g).to(device)
        logits = model.compute_logits(model(ids, ForwardContext.no_cache([num_tokens], device)))
    finally:
        for h in hooks:
            h.remove()
    for name, ok in finite:
        if not bool(ok):
            raise RuntimeError(f"random weights give non-finite activations at the output of {name}; "
                               "the dummy weight scales (deepinfer/models/dummy.py) do not suit this config")
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("random weights give non-finite logits; the dummy weight scales "
                           "(deepinfer/models/dummy.py) do not suit this config")


def _all_finite(out: torch.Tensor | tuple) -> torch.Tensor:
    """A layer's output is finite (a V4.1 layer returns its streams and its FFN's pre)."""
    tensors = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def free_memory(device: torch.device) -> None:
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab_size: int, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(n)]


def step_outputs(engine: Engine) -> list[RequestOutput]:
    """One engine step; a request that ends in error stops the benchmark."""
    outs = engine.step()
    for out in outs:
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed during the benchmark: {out.error}")
    return outs


def drain(engine: Engine, request_ids: list[str]) -> None:
    """Abort ``request_ids`` and step until the engine holds nothing (their KV blocks are free)."""
    for rid in request_ids:
        engine.abort(rid)
    while engine.has_unfinished() or engine.requests:
        engine.step()


class RoutingRecorder:
    """Forward hooks on the MoE routers that keep each call's expert ids (device tensors, so
    recording does not synchronise). Calls made by CUDA-graph replays are not seen (the decode
    bench runs its recorded warm-up steps eagerly); with no call recorded
    :meth:`distinct_per_layer` returns None and the caller falls back to the estimate."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV4Router)]
        self.ids: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def record(_module, _inputs, output) -> None:
            self.ids[i].append(output[1])          # [T, K] expert ids
        return record

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def distinct_per_layer(self) -> list[float] | None:
        """Mean distinct experts per recorded call, per layer."""
        if not self.routers or any(not calls for calls in self.ids):
            return None
        return [sum(c.unique().numel() for c in calls) / len(calls) for calls in self.ids]


def timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def header(kind: str, model: BenchModel, floors: dict[str, float], argv: list[str], cp: int = CP
           ) -> dict[str, Any]:
    """The result's common fields; ``cp``: context-parallel ranks, one device each."""
    return {"bench": kind, "date": timestamp(), "command": "deepinfer " + " ".join(argv),
            **model.describe(), "measured": floors, "nextn": NEXTN, "cp": cp, "num_gpus": cp}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    cells = [columns] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(title)
    for k, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


def print_header(result: dict[str, Any]) -> None:
    m = result["measured"]
    print(f"deepinfer bench {result['bench']}: {result['model']}, {result['params'] / 1e9:.4g}B parameters "
          f"({result['param_bytes'] / 1e9:.4g} GB as stored), weights {result['weights']}, "
          f"{result['dtype']} on {result['device']}")
    if result.get("weights_in_memory"):
        w = result["weights_in_memory"]
        print(f"weights in device memory after load: {w['total'] / 1e9:.4g} GB (FP8 {w['fp8'] / 1e9:.4g}, "
              f"FP4 {w['fp4'] / 1e9:.4g}, other {w['other'] / 1e9:.4g}); accounted {result['param_bytes'] / 1e9:.4g} GB")
    print(f"measured: HBM copy {m['hbm_gb_s']:,.0f} GB/s, dense matmul {m['matmul_tflop_s']:,.1f} TFLOP/s")


class Timer:
    """Wall time between ``start`` and ``stop``, with the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._t0 = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        sync(self.device)
        return time.perf_counter() - self._t0


def device_kernels(events) -> list:
    """The profiler's device events that are work (kernels, copies, memsets): on the device,
    and not the GPU-side spans of our ``record_function`` ranges (``deepinfer.forward``, ...),
    which the profiler also reports as device events and would count every kernel twice."""
    return [e for e in events if str(getattr(e, "device_type", None)).endswith("CUDA")
            and not getattr(e, "is_user_annotation", False) and not e.key.startswith("deepinfer.")]


# Kernel names of the weight-streaming products: cuBLAS (nvjet on Hopper) and CUTLASS GEMMs and
# GEMVs, and ours (the FP8 GEMM, the fused and FP4 expert GEMMs, the batch-invariant matmul).
_MATMUL_NAME_PARTS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "_gate_up_kernel", "_down_kernel",
                      "_bmm_kernel")


def is_matmul_kernel(name: str) -> bool:
    """Whether a profiled kernel is a matmul (a GEMM, GEMV or expert GEMM), by its name."""
    low = name.lower()
    return any(part in low for part in _MATMUL_NAME_PARTS)


def kernel_split(kernels: list, units: int) -> str:
    """One line per side of the matmul / everything-else split: device ms and launches per unit,
    then the five costliest kernels outside the matmuls (what a fusion would go after)."""
    mm = [e for e in kernels if is_matmul_kernel(e.key)]
    other = [e for e in kernels if not is_matmul_kernel(e.key)]
    lines = []
    for name, group in (("matmuls", mm), ("outside matmuls", other)):
        us = sum(e.self_device_time_total for e in group)
        lines.append(f"{name}: {us / units / 1e3:.3f} ms/unit in {sum(e.count for e in group) / units:.0f} "
                     "launches/unit")
    top = sorted(other, key=lambda e: e.self_device_time_total, reverse=True)[:5]
    lines += [f"  {e.key[:70]}: {e.self_device_time_total / units:.1f} us/unit, {e.count / units:.1f}/unit"
              for e in top]
    return "\n".join(lines)


def invariant_profile_path(path: str | None) -> str | None:
    """Where ``--profile`` writes the batch-invariant mode's profile: ``x.txt`` -> ``x.batch-invariant.txt``."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.batch-invariant{p.suffix}"))


def profile_to_file(path: str, label: str, units: int, work) -> None:
    """Run ``work()`` under torch.profiler and write the kernels by device time to ``path``,
    headed by kernel launches and device time per unit (``units`` of ``label``)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        work()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = device_kernels(events)
    total_us = sum(e.self_device_time_total for e in kernels) if kernels else 0.0
    launches = sum(e.count for e in kernels)
    with open(path, "w") as f:
        f.write(f"{label}: {launches / units:.0f} kernels/unit, {total_us / units / 1e3:.3f} ms kernel "
                "time/unit\n")
        if cuda and env.pdl_enabled():
            # A PDL kernel is launched while the one before it runs and waits inside for it, so
            # the profiler's duration of a kernel after a long one holds that one's time too.
            f.write("PDL on: a kernel's time includes its wait for the kernel before it (the sum can pass "
                    "the step time); DEEPINFER_PDL=0 gives per-kernel times\n")
        f.write(kernel_split(kernels, units) + "\n\n")
        f.write(events.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=60,
                             max_name_column_width=90))
        # Host side: the runner's phases (deepinfer.prepare/forward/sample/finish) and the ops
        # that cost the CPU most, to tell launch-bound or synchronising code from slow kernels.
        f.write("\n\nby CPU time\n")
        f.write(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=90))
    print(f"profile of {label} written to {path}: {launches / units:.0f} kernels/unit")
    print(kernel_split(kernels, units))
