"""host_memory.py on the CPU: read-only file maps at any offset, and HostPin leaving CPU
tensors as they are off CUDA (its registration path runs on the GPU:
tests/kernels/test_engram_gather.py, scripts/probes/v41_cuda_check.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.host_memory import HostPin, map_file


def test_map_file_views_bytes_at_any_offset(tmp_path):
    values = torch.randn(7, 6)
    path = tmp_path / "blob.bin"
    # At byte 4100 (past the first page, 4-byte aligned) and at 5 (misaligned for float32).
    path.write_bytes(b"\1" * 5 + values.numpy().tobytes() + b"\2" * (4095 - 168) + values.numpy().tobytes())
    aligned = map_file(path, 4100, values.numel() * 4, torch.float32, (7, 6))
    assert torch.equal(aligned, values)
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f if "blob.bin" in line]
    assert maps and {m[1] for m in maps} == {"r--s"}
    spans = [(int(lo, 16), int(hi, 16)) for m in maps for lo, hi in [m[0].split("-")]]
    assert any(lo <= aligned.data_ptr() < hi for lo, hi in spans)          # a view of the map
    # Misaligned for its dtype: a copy (never the case in files safetensors writes).
    assert torch.equal(map_file(path, 5, values.numel() * 4, torch.float32, (7, 6)), values)
    assert bytes(map_file(path, 0, 5, torch.uint8, (5,)).tolist()) == b"\1" * 5
    assert map_file(path, 0, 0, torch.float32, (0, 3)).shape == (0, 3)


def test_map_file_checks_sizes(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="do not hold"):
        map_file(path, 0, 60, torch.float32, (4, 4))
    with pytest.raises(ValueError, match="past the end"):
        map_file(path, 32, 64, torch.float32, (4, 4))


def test_host_pin_off_cuda_keeps_the_tensors():
    a, b = torch.randn(3), torch.arange(4)
    pin = HostPin([a, b], torch.device("cpu"))
    assert pin.tensors[0] is a and pin.tensors[1] is b and pin.how == ["host", "host"]
    with pytest.raises(ValueError, match="on the CPU"):
        HostPin([torch.empty(2, device="meta")], torch.device("cpu"))
