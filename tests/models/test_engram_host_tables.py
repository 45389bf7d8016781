"""DeepSeek-V4.1 engram tables kept in host memory (layers/engram.py ``EngramTable``): the
placement rule and its switch, the stored form after loading the tiny reference checkpoint
(FP8 codes and scales mapped read-only from the file, never dequantised), bit-identical
logits to the device tables, dummy weights, and the errors for tables a checkpoint lacks."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer import env
from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.layers.engram import (HOST_TABLE_MIN_BYTES, SCALE_GROUP, EngramRows, EngramTable, table_bytes,
                                     table_in_host_memory)
from deepinfer.models import quant
from deepinfer.models.loader import load_model

DATA = Path(__file__).resolve().parent.parent / "data" / "v41_reference"
CKPT = DATA / "checkpoint"
ENGRAM_LAYERS = (1, 2)


def load(monkeypatch: pytest.MonkeyPatch, placement: str, path: Path = CKPT, **options):
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", placement)
    cfg = ModelConfig.from_path(path, "float32", None, torch.device("cpu"), kv_cache_dtype="float32", **options)
    return load_model(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def models():
    """(device-table model, host-table model) of the reference checkpoint."""
    with pytest.MonkeyPatch.context() as mp:
        return load(mp, "device"), load(mp, "host")


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    ctx = ForwardContext.no_cache([len(ids)], torch.device("cpu"))
    return model.compute_logits(model(torch.tensor(ids), ctx))


def prompts() -> list[list[int]]:
    e = np.load(DATA / "expected.npz")
    ids, off = e["prompt_ids"], e["prompt_offsets"]
    return [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the process memory mapping holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"address {address:#x} is in no mapping")


# -- placement ---------------------------------------------------------------------------------------

def test_placement_rule(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ENGRAM_TABLES", raising=False)
    assert table_in_host_memory(384006168, 256) and table_in_host_memory(384016682, 256)   # the release
    assert not table_in_host_memory(864, 32)                                              # the tiny checkpoint
    # The threshold counts the FP8 form: one byte a value, one a group of 32.
    rows = HOST_TABLE_MIN_BYTES // table_bytes(1, 256)
    assert table_bytes(rows, 256) < HOST_TABLE_MIN_BYTES <= table_bytes(rows + 1, 256)
    assert table_in_host_memory(rows + 1, 256) and not table_in_host_memory(rows, 256)
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "host")
    assert table_in_host_memory(864, 32)
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", " Device ")
    assert not table_in_host_memory(384006168, 256)
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "gpu")
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_TABLES='gpu'.*auto, host, device"):
        env.engram_table_placement()


# -- loading ---------------------------------------------------------------------------------------

def test_host_tables_keep_the_checkpoint_fp8_bytes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a host-memory engram table was dequantised")

    monkeypatch.setattr(quant, "dequant_engram_table", refuse)
    model = load(monkeypatch, "host")
    assert not any("engram.embed" in name for name in model.state_dict())
    with safe_open(str(CKPT / "model.safetensors"), framework="pt") as f:
        for i in ENGRAM_LAYERS:
            table = model.model.layers[i].engram.embed
            rows, width = table.num_embeddings, table.head_dim
            assert table.in_host_memory and not hasattr(table, "weight")
            assert table.codes.dtype == torch.float8_e4m3fn and table.codes.shape == (rows, width)
            assert table.scales.dtype == torch.float8_e8m0fnu and table.scales.shape == (rows, width // SCALE_GROUP)
            # Memory after load: the FP8 form, a quarter of a float32 table plus 1/32 for the scales.
            stored = table.codes.nbytes + table.scales.nbytes
            assert stored == table_bytes(rows, width) == rows * width * 33 // 32
            assert torch.equal(table.codes.view(torch.uint8),
                               f.get_tensor(f"layers.{i}.engram.embed.weight").view(torch.uint8))
            assert torch.equal(table.scales.view(torch.uint8),
                               f.get_tensor(f"layers.{i}.engram.embed.scale").view(torch.uint8))
            # Mapped from the checkpoint file, shared and read-only: the page cache's own pages.
            for t in (table.codes, table.scales):
                perms, path = mapping_of(t.data_ptr())
                assert perms == "r--s" and path.endswith("v41_reference/checkpoint/model.safetensors")


def test_device_tables_are_dequantised(models):
    device, _ = models
    table = device.model.layers[1].engram.embed
    assert not table.in_host_memory and table.host is None
    assert table.weight.dtype == torch.float32 and table.weight.shape == (660, 32)


def test_host_tables_give_bit_identical_logits(models):
    device, host = models
    for ids in prompts()[:4]:
        assert torch.equal(full_logits(host, ids), full_logits(device, ids))


def test_triton_gather_reads_the_host_table_exactly(models, monkeypatch):
    device, host = models
    g = torch.Generator().manual_seed(0)
    for i in ENGRAM_LAYERS:
        rows = host.model.layers[i].engram.embed.num_embeddings
        ids = torch.randint(0, rows, (7, 6), generator=g)
        want = device.model.layers[i].engram.lookup(ids)
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
        got = host.model.layers[i].engram.lookup(ids)
        monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND")
        assert got.shape == want.shape == (7, 6 * 32) and torch.equal(got, want)


def test_dummy_weights_fill_host_tables(monkeypatch):
    model = load(monkeypatch, "host", load_format="dummy")
    table = model.model.layers[1].engram.embed
    values = quant.dequant_engram_table(table.codes, table.scales)
    assert values.isfinite().all() and (values != 0).float().mean() > 0.9
    assert 0.5 < float(values.std() * table.head_dim ** 0.5) < 2.0           # N(0, 1/E)
    logits = full_logits(model, prompts()[0][:9])
    assert logits.isfinite().all()


def test_set_fp8_refuses_other_forms():
    table = EngramTable(10, 64, in_host_memory=True)
    codes = torch.zeros(10, 64, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn.*DEEPINFER_ENGRAM_TABLES=device"):
        table.set_fp8(codes.float(), scales, torch.device("cpu"))
    with pytest.raises(ValueError, match="scales must be E8M0"):
        table.set_fp8(codes, scales[:, :1], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="never loaded"):
        table(torch.zeros(1, 2, dtype=torch.int64), torch.float32)


def _copy_edited(tmp_path: Path, edit) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(CKPT, out)
    tensors = load_file(str(CKPT / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _bf16_table(tensors: dict[str, torch.Tensor]) -> None:
    name = "layers.1.engram.embed"
    tensors[f"{name}.weight"] = quant.dequant_engram_table(tensors[f"{name}.weight"],
                                                           tensors.pop(f"{name}.scale")).bfloat16()


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.2.engram.embed.weight"), r"engram table of layer 2 .*layers\.2\.engram\.embed\.weight"),
    (_bf16_table, r"layer 1 .*given: layers\.1\.engram\.embed\.weight, torch\.bfloat16"),
])
def test_missing_or_unquantised_host_tables_are_named(tmp_path, monkeypatch, edit, message):
    path = _copy_edited(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load(monkeypatch, "host", path)
    # On the device any table dtype loads.
    if edit is _bf16_table:
        assert load(monkeypatch, "device", path).model.layers[1].engram.embed.weight.shape == (660, 32)


def test_engram_rows_of_one_forward(models):
    """EngramRows looks every layer's rows up at once (inline on the CPU); a bounded replay
    keeps only its token rows of the lookups not used yet."""
    _, host = models
    engrams = {i: host.model.layers[i].engram for i in ENGRAM_LAYERS}
    g = torch.Generator().manual_seed(1)
    hash_ids = torch.stack([torch.randint(0, e.embed.num_embeddings, (5, 6), generator=g)
                            for e in engrams.values()], dim=1)                       # [T, 2, C]
    rows = EngramRows(engrams, hash_ids)
    assert torch.equal(rows.pop(1), engrams[1].lookup(hash_ids[:, 0]))
    keep = torch.tensor([4, 1])
    rows.take(keep)
    assert torch.equal(rows.pop(2), engrams[2].lookup(hash_ids[keep, 1]))
    rows.finish()
