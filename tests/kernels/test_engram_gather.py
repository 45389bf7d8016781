"""DeepSeek-V4.1 engram row gather (deepinfer/kernels/engram_gather.py) against
:func:`reference.engram_gather` on random FP8 tables, and the reference against the whole-table
dequantisation the device path uses (models/quant.py ``dequant_engram_table``)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.engram_gather import engram_gather
from deepinfer.models.quant import dequant_engram_table


def random_table(rows: int, width: int, groups: int, gen: torch.Generator, nan_codes: bool = False,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, width] float8_e4m3fn, scales [rows, groups]): every E4M3 byte but NaN
    (both signs, subnormals, zeros), power-of-two scales 2^-5 .. 2^5 (exact in float16 too)."""
    codes = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.uint8)
    if not nan_codes:
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)             # S.1111.111 is NaN
    exps = torch.randint(127 - 5, 127 + 6, (rows, groups), generator=gen, dtype=torch.uint8)
    if scale_dtype == torch.float32:
        scales = torch.exp2(exps.float() - 127)
    else:
        scales = exps.view(scale_dtype) if scale_dtype == torch.float8_e8m0fnu else exps
    return codes.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("rows, width, groups, t, c", [
    (50, 32, 1, 5, 6),         # the tiny checkpoint's row: one group
    (37, 256, 8, 3, 24),       # the release's row and 24 hash columns
    (20, 96, 3, 7, 2),         # groups not a power of two
    (9, 64, 4, 1, 3),          # one token
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_matches_reference(device, rows, width, groups, t, c, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + width + t)
    codes, scales = random_table(rows, width, groups, gen)
    # Out-of-table ids (negative, >= rows) give zero rows.
    ids = torch.randint(0, rows, (t, c), generator=gen)
    ids[0, 0], ids[-1, -1] = -1, rows
    got = engram_gather(codes.to(device), scales.to(device), ids.to(device), dtype)
    want = reference.engram_gather(codes, scales, ids, dtype)
    assert got.shape == (t, c, width) and got.dtype == dtype
    # Every value is an E4M3 value times a power of two: exact in all three dtypes.
    assert torch.equal(got.cpu(), want)
    assert (want.float().abs().sum(-1) > 0).any()
    outside = (ids < 0) | (ids >= rows)
    assert outside.any() and (want[outside] == 0).all()


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32])
def test_scale_dtypes_and_strided_int32_ids(device, scale_dtype):
    gen = torch.Generator().manual_seed(3)
    codes, scales = random_table(40, 64, 2, gen, scale_dtype=scale_dtype)
    all_ids = torch.randint(0, 40, (6, 3, 5), generator=gen, dtype=torch.int32)
    ids = all_ids[:, 1]                                     # one engram layer's columns: a strided view
    got = engram_gather(codes.to(device), scales.to(device), ids.to(device), torch.float32).cpu()
    assert torch.equal(got, reference.engram_gather(codes, scales, ids, torch.float32))


def test_nan_codes_stay_nan(device):
    gen = torch.Generator().manual_seed(4)
    codes, scales = random_table(16, 32, 1, gen, nan_codes=True)
    ids = torch.arange(16).view(4, 4)
    got = engram_gather(codes.to(device), scales.to(device), ids.to(device), torch.float32).cpu()
    want = reference.engram_gather(codes, scales, ids, torch.float32)
    assert want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_reference_equals_whole_table_dequantisation():
    """The rows the host path gathers are the rows the device path's dequantised table holds,
    rounded alike to the compute dtype."""
    gen = torch.Generator().manual_seed(5)
    codes, scales = random_table(30, 96, 3, gen)
    ids = torch.randint(0, 30, (4, 6), generator=gen)
    table = dequant_engram_table(codes, scales)                                  # float32 [30, 96]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(reference.engram_gather(codes, scales, ids, dtype), table.to(dtype)[ids])


def test_launcher_checks_shapes():
    gen = torch.Generator().manual_seed(6)
    codes, scales = random_table(8, 64, 2, gen)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="scales must be"):
        engram_gather(codes, scales[:4], ids, torch.float32)
    with pytest.raises(ValueError, match="power-of-two size"):
        engram_gather(codes, torch.zeros(8, 3, dtype=torch.uint8), ids, torch.float32)
    with pytest.raises(ValueError, match="ids must be"):
        engram_gather(codes, scales, ids.float(), torch.float32)
    with pytest.raises(ValueError, match="codes must be"):
        engram_gather(codes.float(), scales, ids, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_reads_pinned_host_tables_in_cuda_graphs(tmp_path):
    """The release's row (256 values, 8 scales) and 24 columns, the table in host memory, both
    as a pinned copy and as a registered read-only map of a file (``host_memory``), the ids on
    the device; captured once and replayed with new ids."""
    from deepinfer.host_memory import HostPin, map_file
    from tests.kernels.conftest import capture
    gen = torch.Generator().manual_seed(7)
    codes, scales = random_table(5000, 256, 8, gen)
    path = tmp_path / "table.bin"
    # Byte 100 on: not page-aligned, as a table inside a safetensors file is not.
    path.write_bytes(b"\0" * 100 + codes.view(torch.uint8).numpy().tobytes()
                     + scales.view(torch.uint8).numpy().tobytes())
    mapped = HostPin([map_file(path, 100, codes.numel(), torch.float8_e4m3fn, (5000, 256)),
                      map_file(path, 100 + codes.numel(), scales.numel(), torch.float8_e8m0fnu, (5000, 8))],
                     torch.device("cuda"))
    copies = (codes.pin_memory(), scales.pin_memory())
    for table in (mapped.tensors, copies):
        assert table[0].device.type == "cpu" and table[0].is_pinned()
        ids = torch.randint(0, 5000, (64, 24), generator=gen).cuda()
        graph, out = capture(lambda: engram_gather(table[0], table[1], ids, torch.bfloat16))
        for _ in range(2):
            new = torch.randint(0, 5000, (64, 24), generator=gen)
            ids.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), reference.engram_gather(codes, scales, new, torch.bfloat16))
