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
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

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
    data: bytes                 # the group's part of the page


@dataclass
class KVExport:
    fingerprint: str
    num_tokens: list[int]       # per prompt: the prefix tokens its blocks serve
    blocks: list[ExportedBlock] = field(default_factory=list)


@dataclass
class ImportResult:
    imported: int               # blocks now in the host tier
    skipped: int                # blocks this engine held already (or its host tier could not take)


def engine_fingerprint(engine: Engine) -> str:
    return config_fingerprint(engine.config, engine.runner.groups)


def encode(export: KVExport) -> bytes:
    header = json.dumps({
        "version": FORMAT_VERSION, "fingerprint": export.fingerprint, "num_tokens": export.num_tokens,
        "blocks": [{"group": b.group, "keys": [k.hex() for k in b.keys], "nbytes": len(b.data)}
                   for b in export.blocks]}).encode()
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *(b.data for b in export.blocks)])


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
        offset = head + n
        if len(blob) != offset + sum(sizes):
            raise ValueError(f"KV export is {len(blob)} bytes, its header describes {offset + sum(sizes)}")
        blocks = []
        for meta, size in zip(metas, sizes):
            blocks.append(ExportedBlock(int(meta["group"]), [bytes.fromhex(k) for k in meta["keys"]],
                                        blob[offset:offset + size]))
            offset += size
        return KVExport(str(header["fingerprint"]), [int(t) for t in header["num_tokens"]], blocks)
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"KV export header is malformed: {type(exc).__name__}: {exc}") from exc


def export_prompts(engine: Engine, prompts: Sequence[Sequence[int]]) -> KVExport:
    """The device-cached blocks of each prompt's longest prefix hit (each block once). Call
    it on the engine's thread, after the prompts were computed: blocks the cache evicted
    since are missing, and the importing engine computes those tokens itself."""
    export = KVExport(engine_fingerprint(engine), [])
    seen: set[bytes] = set()
    for ids in prompts:
        hit, blocks = engine.kv.prefix_blocks(ids)
        export.num_tokens.append(hit)
        for group, block, keys in blocks:
            if keys[-1] not in seen:
                seen.add(keys[-1])
                export.blocks.append(ExportedBlock(group, keys, engine.runner.read_kv_block(group, block)))
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
        if len(b.data) != groups[b.group].bytes_per_block or not b.keys:
            raise ValueError(f"KV export block of group {b.group}: {len(b.data)} bytes and {len(b.keys)} keys; "
                             f"this engine's blocks of that group are {groups[b.group].bytes_per_block} bytes "
                             f"with at least one key")
    imported = 0
    for b in export.blocks:
        entry = engine.kv.import_block(b.group, b.keys)
        if entry is not None:
            engine.runner.kv_tiers.put_host(entry.slot, b.data)
            imported += 1
    return ImportResult(imported, len(export.blocks) - imported)
