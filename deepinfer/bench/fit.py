"""Will the model under test fit the device? Asked before anything is allocated.

A benchmark builds its model on random weights at real widths: a model larger than the
device's memory would otherwise be found out by the allocator (CUDA) or, on the CPU, by
the kernel's OOM killer minutes into the build, with no message. The bytes needed are
the parameter bytes counted from the config's shapes (bench/floors.py), the KV cache the
run's tokens write (on the CPU at least the engine's fixed CPU cache budget, which it
allocates whole), and a margin for activations and the allocator: 10% of the parameter
bytes plus 1 GiB. The bytes free are CUDA's ``mem_get_info`` on CUDA; on the CPU
``MemAvailable`` of /proc/meminfo (else ``os.sysconf``), capped by the cgroup's limit
less its usage where one is set.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GIB = 1 << 30
# Activations, the allocator's slack, the sampler and the probes: a share of the weights
# plus a fixed amount.
MARGIN_SHARE = 0.10
MARGIN_BYTES = GIB


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """The cgroup's memory limit less its usage (v2, else v1); None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:     # v1 reports "no limit" as a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def host_available_bytes() -> int:
    """Memory this process may still take on the host."""
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()


def required_bytes(param_bytes: int, kv_bytes: int, device: torch.device, cpu_kv_cache_bytes: int) -> dict[str, int]:
    """What the model needs on ``device``: weights, KV cache, margin, and their total."""
    if device.type != "cuda":
        kv_bytes = max(kv_bytes, cpu_kv_cache_bytes)
    margin = int(MARGIN_SHARE * param_bytes) + MARGIN_BYTES
    return {"param_bytes": param_bytes, "kv_bytes": int(kv_bytes), "margin_bytes": margin,
            "total": param_bytes + int(kv_bytes) + margin}


def check_fits(label: str, device: torch.device, param_bytes: int, kv_bytes: int, cpu_kv_cache_bytes: int,
               free: int | None = None) -> dict[str, int]:
    """Raise ValueError when the model cannot fit ``device``'s free memory (``free``, measured
    now when None), with both byte counts and what to change; else the counts."""
    need = required_bytes(param_bytes, kv_bytes, device, cpu_kv_cache_bytes)
    free = available_bytes(device) if free is None else free
    if need["total"] > free:
        where = "on CUDA" if device.type == "cuda" else "on the CPU"
        raise ValueError(
            f"{label} does not fit {where}: it needs {need['total']:,} bytes ({need['total'] / GIB:.1f} GiB: "
            f"{need['param_bytes'] / GIB:.1f} GiB of weights, {need['kv_bytes'] / GIB:.2f} GiB of KV cache, "
            f"{need['margin_bytes'] / GIB:.1f} GiB margin for activations) and {free:,} bytes "
            f"({free / GIB:.1f} GiB) are free. Use fewer layers (--num-layers), shorter or fewer requests, "
            "or a larger device; with no --config the CPU runs the embedded tiny model")
    return {**need, "free": free}
