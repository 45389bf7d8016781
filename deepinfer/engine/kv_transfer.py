"""Prefill/decode disaggregation: a prompt's KV blocks as bytes, out of one engine and into another.

What belongs here: the wire format of a KV export and the two engine-side operations, run
on the engine's own thread between steps: ``export_prompts`` (a prefill instance, after it
computed the prompts: the blocks of each prompt's longest prefix hit in its device cache)
and ``import_blocks`` (a decode instance: the blocks become entries of its host tier,
scheduler/kv_tiers.py, under the same keys). The decode instance then serves the request
as any other: its prefix lookup finds those entries, loads them back and recomputes only
the tokens past the last whole base block, so its output is a single instance's (a prefix
hit is exact). What does not belong here: which instance prefills (deepinfer/router/),
HTTP (entrypoints/openai/kv_routes.py).

Wire format: ``MAGIC``, a little-endian uint32 header length, a JSON header (format
version, the exporting engine's fingerprint: model, dtypes, KV format and cache layout,
runner/kv_offload.py; the tokens the blocks serve; per block its group, keys and payload
size), then the payloads in the header's order. An import checks the fingerprint (another
model or cache layout is refused), each block's group and size.

Same host (``share``, engine/kv_share.py): the payloads stay in a staging buffer both
instances can map (CUDA IPC on a GPU, shared memory on the CPU); the header then carries the
buffer's handle and each block's offset in it, and no payloads follow.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from deepinfer.engine.kv_share import Opened, ShareRegistry
from deepinfer.runner.kv_offload import config_fingerprint

if TYPE_CHECKING:
    from deepinfer.engine.engine import Engine

MAGIC = b"DIKVXFR1"
FORMAT_VERSION = 1
_LEN = struct.Struct("<I")
CONTENT_TYPE = "application/x-deepinfer-kv"


@dataclass
class ExportedBlock:
    group: int
    keys: list[bytes]           # every key the block carries, shortest prefix first
    data: bytes                 # the group's part of the page (empty when shared)
    nbytes: int = -1            # its size; -1: len(data)
    offset: int = 0             # shared: where it starts in the staging buffer

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = len(self.data)


@dataclass
class KVExport:
    fingerprint: str
    num_tokens: list[int]       # per prompt: the prefix tokens its blocks serve
    blocks: list[ExportedBlock] = field(default_factory=list)
    share: dict | None = None   # same host: the staging buffer's handle (engine/kv_share.py)


@dataclass
class ImportResult:
    imported: int               # blocks now in the host tier
    skipped: int                # blocks this engine held already (or its host tier could not take)
    opened: bool = False        # a shared export's buffer was mapped (its release must say so)
    nbytes: int = 0             # bytes imported


def engine_fingerprint(engine: Engine) -> str:
    return config_fingerprint(engine.config, engine.runner.groups)


def encode(export: KVExport) -> bytes:
    header = {
        "version": FORMAT_VERSION, "fingerprint": export.fingerprint, "num_tokens": export.num_tokens,
        "blocks": [{"group": b.group, "keys": [k.hex() for k in b.keys], "nbytes": b.nbytes,
                    **({"offset": b.offset} if export.share else {})} for b in export.blocks]}
    if export.share is not None:
        header["share"] = export.share
    raw = json.dumps(header).encode()
    payloads = [] if export.share is not None else [b.data for b in export.blocks]
    return b"".join([MAGIC, _LEN.pack(len(raw)), raw, *payloads])


def decode(blob: bytes) -> KVExport:
    """The export in ``blob``; ValueError naming what is wrong when it is not a whole one."""
    head = len(MAGIC) + _LEN.size
    if len(blob) < head or blob[:len(MAGIC)] != MAGIC:
        raise ValueError("not a KV export (bad magic)")
    (n,) = _LEN.unpack(blob[len(MAGIC):head])
    try:
        header = json.loads(blob[head:head + n].decode())
        if header["version"] != FORMAT_VERSION:
            raise ValueError(f"KV export format version {header['version']}, this engine reads {FORMAT_VERSION}")
        metas = header["blocks"]
        sizes = [int(m["nbytes"]) for m in metas]
        share = header.get("share")
        offset = head + n
        expected = offset + (0 if share is not None else sum(sizes))
        if len(blob) != expected:
            raise ValueError(f"KV export is {len(blob)} bytes, its header describes {expected}")
        blocks = []
        for meta, size in zip(metas, sizes):
            keys = [bytes.fromhex(k) for k in meta["keys"]]
            if share is not None:
                blocks.append(ExportedBlock(int(meta["group"]), keys, b"", size, int(meta["offset"])))
                continue
            blocks.append(ExportedBlock(int(meta["group"]), keys, blob[offset:offset + size]))
            offset += size
        if share is not None and not isinstance(share, dict):
            raise ValueError("KV export header's share is not an object")
        return KVExport(str(header["fingerprint"]), [int(t) for t in header["num_tokens"]], blocks, share)
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"KV export header is malformed: {type(exc).__name__}: {exc}") from exc


def export_prompts(engine: Engine, prompts: Sequence[Sequence[int]],
                   share: ShareRegistry | None = None) -> KVExport:
    """The device-cached blocks of each prompt's longest prefix hit (each block once). Call
    it on the engine's thread, after the prompts were computed: blocks the cache evicted
    since are missing, and the importing engine computes those tokens itself. With
    ``share`` the blocks are copied into a staging buffer registered there (same-host
    hand-over) instead of into the export."""
    export = KVExport(engine_fingerprint(engine), [])
    seen: set[bytes] = set()
    found: list[tuple[int, int, list[bytes]]] = []
    for ids in prompts:
        hit, blocks = engine.kv.prefix_blocks(ids)
        export.num_tokens.append(hit)
        for group, block, keys in blocks:
            if keys[-1] not in seen:
                seen.add(keys[-1])
                found.append((group, block, keys))
    if share is None:
        export.blocks = [ExportedBlock(g, keys, engine.runner.read_kv_block(g, block)) for g, block, keys in found]
        return export
    groups = engine.runner.groups
    sizes = [groups[g].bytes_per_block for g, _, _ in found]
    staged = share.stage(sum(sizes), engine.runner.kv_buffer.device)
    offset = 0
    for (g, block, keys), size in zip(found, sizes):
        staged.tensor[offset:offset + size].copy_(engine.runner.kv_block_view(g, block))
        export.blocks.append(ExportedBlock(g, keys, b"", size, offset))
        offset += size
    if staged.tensor.is_cuda:
        torch.cuda.synchronize(staged.tensor.device)      # the opener reads it from another process
    export.share = staged.handle
    return export


def import_blocks(engine: Engine, export: KVExport) -> ImportResult:
    """Put ``export``'s blocks into this engine's host tier (on the engine's thread, between
    steps). ValueError when the export is of another model or cache layout, or a block
    does not fit its group; nothing is imported then."""
    if engine.runner.kv_tiers is None or engine.config.cache.kv_offload_bytes == 0:
        raise ValueError("importing KV blocks needs a host tier: set kv_offload_bytes > 0 (--kv-offload-gib)")
    if export.fingerprint != engine_fingerprint(engine):
        raise ValueError("the KV export is of another model, dtype, KV format or cache layout than this engine's")
    groups = engine.runner.groups
    for b in export.blocks:
        if not 0 <= b.group < len(groups):
            raise ValueError(f"KV export block group {b.group} is out of range [0, {len(groups)})")
        if b.nbytes != groups[b.group].bytes_per_block or not b.keys:
            raise ValueError(f"KV export block of group {b.group}: {b.nbytes} bytes and {len(b.keys)} keys; "
                             f"this engine's blocks of that group are {groups[b.group].bytes_per_block} bytes "
                             f"with at least one key")
    if export.share is None:
        imported = _import(engine, export, lambda b: b.data)
        return ImportResult(imported, len(export.blocks) - imported,
                            nbytes=sum(b.nbytes for b in export.blocks))
    opened = Opened(export.share)
    try:
        if any(b.offset < 0 or b.offset + b.nbytes > opened.nbytes for b in export.blocks):
            raise ValueError(f"KV export block lies outside its {opened.nbytes}-byte shared buffer")
        imported = _import(engine, export, lambda b: opened.tensor[b.offset:b.offset + b.nbytes])
    finally:
        opened.close()
    return ImportResult(imported, len(export.blocks) - imported, opened=True, nbytes=opened.nbytes)


def _import(engine: Engine, export: KVExport, payload) -> int:
    imported = 0
    for b in export.blocks:
        entry = engine.kv.import_block(b.group, b.keys)
        if entry is not None:
            engine.runner.kv_tiers.put_host(entry.slot, payload(b))
            imported += 1
    engine.runner.kv_tiers.sync_imports()
    return imported
