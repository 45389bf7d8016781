"""Engine configuration: frozen dataclasses validated at construction.

Every field that a user can set is checked in ``__post_init__`` and a bad value
raises ``ValueError`` naming the field and what to change. Derived values are
properties, never stored twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is bf16 on CUDA and float32 on the CPU (DESIGN.md, Numerics)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint directory and the HF ``config.json`` read from it."""

    path: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    max_model_len: int

    @classmethod
    def from_path(cls, path: str | Path, dtype: str | torch.dtype, max_model_len: int | None,
                  device: torch.device) -> "ModelConfig":
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model={str(path)!r}: no config.json in that directory")
        hf_config = json.loads(cfg_file.read_text())
        limit = int(hf_config.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = limit
        return cls(path=str(p), hf_config=hf_config, dtype=resolve_dtype(dtype, device),
                   max_model_len=max_model_len)

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if not self.hf_config.get("architectures"):
            raise ValueError(f"{self.path}/config.json has no 'architectures' field")

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    On CUDA the cache takes ``gpu_memory_utilization`` of the device's total memory
    minus what weights and a profiling forward use; on the CPU it takes
    ``cpu_kv_cache_bytes``. ``num_gpu_blocks_override`` fixes the block count
    (tests use it to force preemption).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes={self.cpu_kv_cache_bytes} must be >= 1")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"num_blocks_override={self.num_blocks_override} must be >= 2 "
                             "(block 0 is reserved as the null block)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits: sequences per step and tokens per step.

    ``async_scheduling`` (overlapped scheduling, vLLM's name): plan and launch step
    N+1 while the device runs step N, and post-process step N while it runs N+1.
    Outputs are the same either way (scheduler/scheduler.py says when it falls back
    to a synchronous step).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor, expert, data and context parallel sizes (all 1 until parallelism lands)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "cp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
            if value > 1:
                raise NotImplementedError(
                    f"{name}={value}: parallelism needs {value} devices and is not yet supported; "
                    f"run with {name}=1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheduler.max_num_batched_tokens < self.cache.block_size:
            raise ValueError(
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens} must be >= "
                f"block_size={self.cache.block_size}")
        if (not self.scheduler.enable_chunked_prefill
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens} must be >= max_model_len="
                f"{self.model.max_model_len}")
