"""The DEEPINFER_* environment switches: the only module that reads them.

Configuration belongs in the frozen dataclasses of ``config.py``; the variables
here are process-wide switches for debugging and benchmarking that no caller
should have to thread through the engine. Each is read when asked for (so a
test can set it with ``monkeypatch.setenv``) and validated: a bad value raises
``ValueError`` naming the variable and the accepted values.

DEEPINFER_KERNEL_BACKEND  auto | torch | triton  (default auto)
    Which implementation runs the kernels that have both (every function of
    ``kernels/backend.py``: norms, RoPE, KV-cache store, paged/sparse/MLA attention,
    indexer, MoE routing and experts, hyper-connections, sampling filters, DeepSeek-V4.1's
    pair pooling, candidate blocks, engram gate and engram row gather). ``torch``: the
    pure-PyTorch references of ``kernels/reference.py``, on any device. ``triton``: the Triton kernels of
    ``kernels/``; their tensors must be on CUDA, or on the CPU with
    ``TRITON_INTERPRET=1`` (Triton's interpreter, slow, for tests). ``auto``:
    Triton for CUDA tensors when the ``triton`` package imports, torch otherwise.

DEEPINFER_PDL  1 | 0  (default 1)
    Programmatic dependent launch of the Triton kernels on Hopper and later
    (``kernels/pdl.py``): each kernel is launched while the previous one runs and waits
    for it on the device. ``0``: plain launches.

DEEPINFER_SIDE_STREAM  1 | 0  (default 1)
    Independent branches of a small-batch DeepSeek-V4 layer (the shared expert beside the
    routed experts, the compressor and indexer beside the query projection) on a second
    CUDA stream (``layers/side_stream.py``). ``0``: everything on one stream.

DEEPINFER_ENGRAM_TABLES  auto | host | device  (default auto)
    Where DeepSeek-V4.1's engram hash tables live (``layers/engram.py``). ``host``: in host
    memory (pinned on CUDA) in the checkpoint's FP8 form, the rows a step needs gathered and
    dequantised on the device. ``device``: dequantised into the compute dtype on the model's
    device. ``auto``: host for tables of at least ``engram.HOST_TABLE_MIN_BYTES`` in FP8
    (the release's ~98 GB tables), device below (small models).

DEEPINFER_GLUON_ATTENTION  1 | 0  (default 1)
    Long 16-bit prefill chunks of DeepSeek-V4 sparse attention (64 heads x 512, T >= 2048) on
    Hopper take the Gluon kernel of ``kernels/sparse_attention_gluon.py``, which also applies the
    query's norm + rope and the output's inverse rope. ``0``: the Triton kernels everywhere.

DEEPINFER_BATCH_INVARIANT  1 | 0  (default 0)
    Batch-invariant mode (``batch_invariant.py``): a request's tokens and logprobs are bitwise
    the same whatever shares its batch and however its prompt is chunked. The default of
    ``EngineConfig.batch_invariant``; on the CPU and on one CUDA device (what is not covered
    is refused at start-up: ``batch_invariant.check_supported``).

DEEPINFER_USE_NEXTN_DECODE  int in [1, 16]  (default 5)
    Speculative decoding's longest draft: the default of
    ``SpeculativeConfig.num_speculative_tokens``.

DEEPINFER_ENABLE_MTP_VARLEN  1 | 0  (default 0)
    Confidence-scheduled variable-length verification (``spec/scheduling.py``): each step
    verifies the prefix of every draft that the hardware-aware scheduler picks instead of all
    of it. The default of ``SpeculativeConfig.varlen``.

DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE  full | exact | compact  (default full)
    Bounded replay of a prompt (DeepSeek's "YOCO prefill truncation"): the layers after a
    model's last KV-source layer run only on each prompt's last tokens. ``full``: every layer
    sees every token. ``exact`` / ``compact``: the model's two truncated forms (models that
    have none refuse them at start-up). The default of ``SchedulerConfig.prefill_truncation_mode``.

DEEPINFER_YOCO_PREFILL_KEEP_TOKENS  int >= 1  (default 140)
    How many trailing prompt tokens bounded replay keeps for the late layers (the model may
    ask for more, see ``CausalLM.replay_keep_tokens``). The default of
    ``SchedulerConfig.prefill_keep_tokens``.
"""

from __future__ import annotations

import functools
import os
from typing import Literal, get_args

KernelBackend = Literal["auto", "torch", "triton"]
EngramTablePlacement = Literal["auto", "host", "device"]
PrefillTruncationMode = Literal["full", "exact", "compact"]
PREFILL_TRUNCATION_MODES: tuple[str, ...] = get_args(PrefillTruncationMode)


def kernel_backend() -> KernelBackend:
    """DEEPINFER_KERNEL_BACKEND (see the module docstring). Read at every kernel call (eager
    steps make ~150), so the parse of each raw value is remembered."""
    return _kernel_backend(os.environ.get("DEEPINFER_KERNEL_BACKEND", "auto"))


@functools.lru_cache(maxsize=8)
def _kernel_backend(raw: str) -> KernelBackend:
    value = raw.strip().lower()
    if value not in get_args(KernelBackend):
        raise ValueError(f"DEEPINFER_KERNEL_BACKEND={value!r} is not valid; choose one of "
                         f"{', '.join(get_args(KernelBackend))}")
    return value  # type: ignore[return-value]


def _switch(name: str, default: str = "1") -> bool:
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} is not valid; choose 1 or 0")
    return value == "1"


def pdl_enabled() -> bool:
    """DEEPINFER_PDL (see the module docstring)."""
    return _switch("DEEPINFER_PDL")


def batch_invariant() -> bool:
    """DEEPINFER_BATCH_INVARIANT (see the module docstring)."""
    return _switch("DEEPINFER_BATCH_INVARIANT", default="0")


def side_stream_enabled() -> bool:
    """DEEPINFER_SIDE_STREAM (see the module docstring)."""
    return _switch("DEEPINFER_SIDE_STREAM")


def engram_table_placement() -> EngramTablePlacement:
    """DEEPINFER_ENGRAM_TABLES (see the module docstring)."""
    value = os.environ.get("DEEPINFER_ENGRAM_TABLES", "auto").strip().lower()
    if value not in get_args(EngramTablePlacement):
        raise ValueError(f"DEEPINFER_ENGRAM_TABLES={value!r} is not valid; choose one of "
                         f"{', '.join(get_args(EngramTablePlacement))}")
    return value  # type: ignore[return-value]


def gluon_attention_enabled() -> bool:
    """DEEPINFER_GLUON_ATTENTION (see the module docstring)."""
    return _switch("DEEPINFER_GLUON_ATTENTION")


def yoco_prefill_truncation_mode() -> PrefillTruncationMode:
    """DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE (see the module docstring)."""
    value = os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "full").strip().lower()
    if value not in PREFILL_TRUNCATION_MODES:
        raise ValueError(f"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE={value!r} is not valid; choose one of "
                         f"{', '.join(PREFILL_TRUNCATION_MODES)}")
    return value  # type: ignore[return-value]


def yoco_prefill_keep_tokens() -> int:
    """DEEPINFER_YOCO_PREFILL_KEEP_TOKENS (see the module docstring)."""
    value = os.environ.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "140").strip()
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ValueError(f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={value!r} is not valid; choose an integer >= 1")
    return int(value)


def use_nextn_decode() -> int:
    """DEEPINFER_USE_NEXTN_DECODE (see the module docstring)."""
    raw = os.environ.get("DEEPINFER_USE_NEXTN_DECODE", "5").strip()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 16:
        raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={raw!r} is not valid; give an int in [1, 16]")
    return value


def enable_mtp_varlen() -> bool:
    """DEEPINFER_ENABLE_MTP_VARLEN (see the module docstring)."""
    return _switch("DEEPINFER_ENABLE_MTP_VARLEN", default="0")
