"""Registers, spill bytes, shared memory and load pipelining of Triton kernels compiled for
sm_90 (H100/H200) on a machine without a GPU: Triton compiles to a cubin with its bundled
ptxas, and cuobjdump reads the cubin's resource usage.

A kernel config at the register limit spills (STACK > 0 below), and a gather whose load is
not turned into an asynchronous copy is not pipelined; both show here in seconds, before a
GPU run. They are not timings: a config with fewer spills is not always faster (measure on
the device), but a kernel that spills inside its loop or loads synchronously is worth a look.

    python scripts/probes/sm90_resources.py                 # every case below
    python scripts/probes/sm90_resources.py sparse_prefill  # cases whose name starts so

The launch specialisation must match the runtime's, or the report is wrong: integer
arguments that are multiples of 16 (and 16-byte aligned pointers) carry a divisibility hint,
and integers equal to 1 become constants. Without the hints Triton cannot prove a gather's
rows 16-byte aligned and never makes it an asynchronous copy. The cases below state them.

The Triton here should be the device's (3.6 on the H200 image): with a newer one installed,
``pip install --target /tmp/triton36 --no-deps triton==3.6.0`` and run with
``PYTHONPATH=/tmp/triton36``.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.kernels import fused_moe, hyper_connection, indexer, kv_records, rms_norm, topk  # noqa: E402
from deepinfer.kernels import candidate_blocks, engram_gate, engram_gather, pool_window  # noqa: E402
from deepinfer.kernels import sparse_attention, sparse_attention_gluon  # noqa: E402


@dataclass
class Case:
    """One kernel launch to compile: ``types`` maps each runtime argument to its Triton type
    ("*bf16", "i32", "fp32", "tensordesc<bf16[128, 64]>"); ``constants`` are the constexprs and
    the arguments the runtime specialises to constants (those equal to 1); ``divisible`` names
    the arguments that carry the divisibility-by-16 hint."""

    kernel: triton.runtime.JITFunction
    types: dict[str, str]
    constants: dict[str, object]
    divisible: set[str]
    num_warps: int
    num_stages: int
    options: dict[str, object] = field(default_factory=dict)


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(case: Case) -> dict[str, int]:
    """Compile ``case`` for sm_90; registers per thread, spill stack bytes, shared memory bytes,
    and how many global loads became asynchronous copies (cp.async or TMA) vs stayed plain."""
    names = case.kernel.arg_names
    signature = {n: case.types.get(n, "constexpr") for n in names}
    missing = [p.name for p in case.kernel.params if p.name not in case.types
               and p.name not in case.constants and p.default is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"{case.kernel.__name__}: no type or constant for {missing}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.divisible}
    if getattr(case.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(case.kernel, signature, dict(case.constants), attrs)
    else:
        src = ASTSource(case.kernel, signature, dict(case.constants), attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=case.num_warps, num_stages=case.num_stages,
                                           **case.options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ttgir = compiled.asm["ttgir"]
    return {"regs": regs, "spill_bytes": stack, "smem": compiled.metadata.shared,
            "async_loads": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local"),
            "plain_loads": ttgir.count("= tt.load")}


# --- cases: DeepSeek-V4-Flash shapes as the engine launches them on the H200 ---------------

_SPARSE_TYPES = {
    "q_ptr": "*bf16", "sinks_ptr": "*fp32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
    "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "cache0_ptr": "*bf16", "slots0_ptr": "*i32",
    "cache1_ptr": "*bf16", "slots1_ptr": "*i32", "k0": "i32", "k1": "i32", "num_heads": "i32",
    "head_dim": "i32", "tiles_per_split": "i32", "qk_scale": "fp32",
    "stride_q_t": "i32", "stride_q_h": "i32", "stride_out_t": "i32", "stride_out_h": "i32",
    "stride_slots0_t": "i32", "stride_cache0_block": "i32", "stride_cache0_offset": "i32",
    "stride_slots1_t": "i32", "stride_cache1_block": "i32", "stride_cache1_offset": "i32",
}


def _sparse(two_sources: bool, block_n: int, stages: int, split: bool, block_h: int = 64,
            warps: int = 8, scan: int = 512, packed: bool = False) -> Case:
    # Slot rows are read with unit stride (stride_slots*_k == 1: a constant at run time);
    # every other integer is a multiple of 16 at 64 heads x 512, window 128, top-512 (``packed``:
    # DeepSeek-V4.1's uint8 records, MXFP8 window rows of 528 B and NVFP4 entries of 288 B).
    divisible = {n for n in _SPARSE_TYPES if n.endswith("_ptr") or n.startswith("stride")
                 or n in ("k0", "k1", "num_heads", "head_dim")}
    types = dict(_SPARSE_TYPES, cache0_ptr="*u8", cache1_ptr="*u8") if packed else _SPARSE_TYPES
    formats = dict(FMT0=1, FMT1=2) if packed else {}
    return Case(sparse_attention._sparse_attention_kernel, types,
                dict(stride_slots0_k=1, stride_slots1_k=1, BLOCK_SIZE0=16, BLOCK_SIZE1=16,
                     TWO_SOURCES=two_sources, SPLIT=split, BLOCK_H=block_h, BLOCK_N=block_n,
                     BLOCK_D=512, BLOCK_SCAN=scan, ONE_SCAN=True, EVEN_H=True, EVEN_D=True,
                     DOT_PRECISION="tf32", PDL=True, **formats),
                divisible, warps, stages, options={"launch_pdl": True})


def _moe_gate_up(cfg: fused_moe.MoEConfig, packed: bool = False) -> Case:
    # Packed weights: the kernel ignores stride_wn, which is then TILE_K (64), a multiple of 16.
    types = {"x": "*bf16", "w": f"tensordesc<bf16[{cfg.block_n1}, {cfg.block_k1}]>" if cfg.tma else "*bf16",
             "act_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "num_pairs": "i32", "hidden": "i32", "inter": "i32",
             "num_pid_m": "i32", "limit": "fp32", "stride_x": "i32", "stride_we": "i32",
             "stride_wn": "i32", "stride_act": "i32"}
    divisible = {"x", "w", "act_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "num_pairs",
                 "hidden", "inter", "stride_x", "stride_we", "stride_wn", "stride_act"}
    return Case(fused_moe._gate_up_kernel, types,
                dict(TOP_K=6, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
                     GROUP_M=cfg.group_m, HAS_LIMIT=True, EVEN_K=True, DOT_PRECISION="tf32",
                     TMA=cfg.tma, SORTED_ACT=cfg.sorted_act, PACKED=packed,
                     TILE_N=fused_moe.GATE_UP_TILE[0], TILE_K=fused_moe.GATE_UP_TILE[1], PDL=True),
                divisible, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


def _gluon_sparse(two_sources: bool, rope: bool) -> Case:
    kernel = sparse_attention_gluon._sparse_prefill_kernel
    types = {n: t for n, t in _SPARSE_TYPES.items() if n in kernel.arg_names}
    types.update({"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "rope_scaling": "fp32", "eps": "fp32",
                  "slots0_ptr": "*i64", "slots1_ptr": "*i64"})
    divisible = {n for n in types if n.endswith("_ptr") or n.startswith("stride") or n in ("k0", "k1")}
    return Case(kernel, types, dict(BLOCK_SIZE0=16, BLOCK_SIZE1=16, TWO_SOURCES=two_sources, BLOCK_N=64,
                                    BLOCK_SCAN=512, ROPE=rope, ROPE_HALF=32), divisible, 8, 1)


def _moe_down(cfg: fused_moe.MoEConfig, packed: bool = False) -> Case:
    sorted_tma = cfg.tma and cfg.sorted_act
    types = {"act": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k2}]>" if sorted_tma else "*bf16",
             "w": f"tensordesc<bf16[{cfg.block_n2}, {cfg.block_k2}]>" if cfg.tma else "*bf16",
             "out_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "num_pairs": "i32", "hidden": "i32", "inter": "i32",
             "num_pid_m": "i32", "stride_act": "i32", "stride_we": "i32", "stride_wn": "i32",
             "stride_out": "i32"}
    divisible = {"act", "w", "out_ptr", "weights_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr",
                 "num_pairs", "hidden", "inter", "stride_act", "stride_we", "stride_wn", "stride_out"}
    return Case(fused_moe._down_kernel, types,
                dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, GROUP_M=cfg.group_m,
                     EVEN_K=True, DOT_PRECISION="tf32", TMA=cfg.tma, SORTED_ACT=cfg.sorted_act,
                     PACKED=packed, TILE_N=fused_moe.DOWN_TILE[0], TILE_K=fused_moe.DOWN_TILE[1], PDL=True),
                divisible, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


def _hc_collapse(norm: bool, copies: bool = False) -> Case:
    # V4-Flash: bf16 streams [T, 4, 4096]; with the norm one program per token holds the whole
    # row at rms_norm's tile (row_config), without it 1024-column tiles of 4 warps.
    block_d, warps = rms_norm.row_config(4096) if norm else (1024, 4)
    types = {"s_ptr": "*bf16", "pre_ptr": "*fp32", "w_ptr": "*fp32", "x_ptr": "*bf16", "D": "i32",
             "s_stride": "i32", "x_stride": "i32", "eps": "fp32"}
    return Case(hyper_connection._hc_collapse_kernel, types,
                dict(N=4, BLOCK_D=block_d, NORM=norm, COPIES=copies, PDL=True),
                {"s_ptr", "pre_ptr", "w_ptr", "x_ptr", "D", "s_stride", "x_stride"}, warps, 3,
                options={"launch_pdl": True})


def _hc_pre(block_t: int, block_k: int, warps: int, stages: int, copies: bool = False) -> Case:
    # V4-Flash prefill: bf16 streams [T, 4 * 4096], fn float32 [24, 16384] split into bf16 parts.
    types = {"s_ptr": "*bf16", "fn_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
             "part_ptr": "*fp32", "count_ptr": "*i32", "x_ptr": "*bf16", "pre_ptr": "*fp32",
             "post_ptr": "*fp32", "comb_ptr": "*fp32", "T": "i32", "D": "i32", "s_stride": "i32",
             "x_stride": "i32", "cols_per_split": "i32", "n_splits": "i32", "sinkhorn_iters": "i32",
             "hc_eps": "fp32", "norm_eps": "fp32"}
    divisible = {n for n in types if n.endswith("_ptr")} | {"T", "D", "s_stride", "x_stride", "cols_per_split"}
    return Case(hyper_connection._hc_pre_kernel, types,
                dict(N=4, NP=4, NMIX=24, NCOL=32, FULL=True, COLLAPSE=False, PRECISION="tf32x3", USE_DOT=True,
                     BF16_SPLIT=True, BF16_DOT=True, BLOCK_T=block_t, BLOCK_K=block_k,
                     BLOCK_S=max(1, min(8, 8192 // (block_t * 32))), BLOCK_D=4096, PDL=True, COPIES=copies),
                divisible, warps, stages, options={"launch_pdl": True})


def _hc_post(copies: bool) -> Case:
    # V4-Flash prefill: block output [T, 4096], bf16 streams [T, 4, 4096] (or one row read 4
    # times), 1024-column tiles of 4 warps.
    types = {"o_ptr": "*bf16", "s_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16",
             "D": "i32", "o_stride": "i32", "s_stride": "i32", "out_stride": "i32"}
    return Case(hyper_connection._hc_post_kernel, types, dict(N=4, NP=4, BLOCK_D=1024, COPIES=copies, PDL=True),
                {"o_ptr", "s_ptr", "post_ptr", "comb_ptr", "out_ptr", "D", "o_stride", "s_stride", "out_stride"},
                4, 3, options={"launch_pdl": True})


def _rms_norm_row() -> Case:
    # The unfused norm the collapse's NORM path must match (same reduction layout).
    block, warps = rms_norm.row_config(4096)
    types = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "x_row_stride": "i32",
             "out_row_stride": "i32", "n_cols": "i32", "eps": "fp32"}
    return Case(rms_norm._rms_norm_kernel, types, dict(BLOCK=block, ROUND_FIRST=False, PDL=True),
                {"x_ptr", "w_ptr", "out_ptr", "x_row_stride", "out_row_stride", "n_cols"}, warps, 3,
                options={"launch_pdl": True})


_INDEXER_TYPES = {
    "q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": "*bf16", "slots_ptr": "*i64", "groups_ptr": "*i32",
    "out_ptr": "*fp32", "t": "i32", "n": "i32", "num_heads": "i32", "head_dim": "i32",
    "tiles_per_split": "i32", "scale": "fp32", "stride_q_t": "i32", "stride_q_h": "i32",
    "stride_w_t": "i32", "stride_slots_t": "i32", "stride_cache_block": "i32",
    "stride_cache_offset": "i32", "stride_out_t": "i32",
}


def _indexer(block_t: int, block_n: int, warps: int, stages: int, packed: bool = False) -> Case:
    # The model's call at T=4096: q [T, 64, 128] from the rope (contiguous), weights [T, 64]
    # float32 (stride_w_h == 1), paged_slots' int64 rows [T, 1024] (stride_slots_n == 1).
    # ``packed``: DeepSeek-V4.1's MXFP4 key records, uint8 rows of 68 B (not a multiple of 16).
    kernel = indexer._indexer_block_kernel if block_t > 1 else indexer._indexer_kernel
    types = {k: v for k, v in _INDEXER_TYPES.items() if k in kernel.arg_names}
    divisible = {k for k in types if k.endswith("_ptr") or k.startswith("stride")
                 or k in ("t", "n", "num_heads", "head_dim")}
    constants = dict(stride_w_h=1, stride_slots_n=1, BLOCK_SIZE=16, BLOCK_N=block_n, BLOCK_HI=64,
                     BLOCK_D=128, DOT_PRECISION="tf32", PDL=True)
    if packed:
        types["cache_ptr"] = "*u8"
        divisible.discard("stride_cache_offset")
        constants["KEY_FMT"] = 3
    if block_t > 1:
        constants["BLOCK_T"] = block_t
    return Case(kernel, types, constants, divisible, warps, stages, options={"launch_pdl": True})


def _topk(block: int, warps: int) -> Case:
    # The indexer's top-512 over paged_slots' int64 rows at T=4096 (N = 1024 candidates).
    types = {"scores_ptr": "*fp32", "slots_ptr": "*i64", "out_ptr": "*i64", "n": "i32", "k": "i32",
             "stride_scores_t": "i32", "stride_slots_t": "i32", "stride_out_t": "i32"}
    divisible = set(types)
    return Case(topk._topk_slots_kernel, types, dict(stride_slots_n=1, BLOCK=block, PDL=True), divisible,
                warps, 1, options={"launch_pdl": True})


# --- DeepSeek-V4.1-Flash's own kernels at the release's shapes ----------------------------------

def _engram_gather() -> Case:
    # A host table (its pointer not 16-byte aligned inside a safetensors file), 24 columns of
    # 256 values, 8 E8M0 scales a row, bf16 rows out; 16 rows a program.
    types = {"codes_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": "*bf16", "n_pairs": "i32",
             "num_rows": "i32", "stride_codes_row": "i32", "stride_scales_row": "i32", "stride_ids_t": "i32",
             "stride_out_t": "i32"}
    return Case(engram_gather._engram_gather_kernel, types,
                dict(stride_ids_c=1, COLS=24, WIDTH=256, GROUPS=8, BLOCK_R=16, BLOCK_G=8, GROUP_SIZE=32,
                     SCALE_BYTES=True, PDL=True),
                {"ids_ptr", "out_ptr", "stride_codes_row", "stride_ids_t", "stride_out_t"}, 4, 3,
                options={"launch_pdl": True})


def _pool_window() -> Case:
    # Ratio-2 bf16 states of 512 channels in 64-token pages.
    types = {"state_ptr": "*bf16", "table_ptr": "*i32", "seq_ptr": "*i32", "pos_ptr": "*i64", "out_ptr": "*fp32",
             "stride_state_block": "i32", "stride_state_offset": "i32", "stride_state_tensor": "i32",
             "stride_table_row": "i32", "stride_out_row": "i32"}
    divisible = {n for n in types if n.endswith("_ptr") or n.startswith("stride")}
    return Case(pool_window._pool_window_kernel, types,
                dict(stride_table_col=1, RATIO=2, HEAD_DIM=512, STATE_BS=64, TABLE_COLS=2048, BLOCK_S=2,
                     BLOCK_D=512, PDL=True), divisible, 4, 3, options={"launch_pdl": True})


def _candidate_blocks(keep: bool) -> Case:
    # Runs of 8 over a ratio-1 stream at 128K tokens; the keep pass's chunks of 1024 runs.
    types = {"scores_ptr": "*fp32", "visible_ptr": "*i64", "runs_ptr": "*fp32", "out_ptr": "*u8", "n_keys": "i32",
             "n_runs": "i32", "k": "i32", "stride_scores_t": "i32", "stride_runs_t": "i32", "stride_out_t": "i32"}
    kernel = candidate_blocks._keep_blocks_kernel if keep else candidate_blocks._block_max_kernel
    types = {n: t for n, t in types.items() if n in kernel.arg_names}
    return Case(kernel, types, dict(BLOCK=8, BLOCK_P2=8, BLOCK_B=1024 if keep else 512, PDL=True), set(types),
                4, 3, options={"launch_pdl": True})


def _engram_gate() -> Case:
    # 4 bf16 streams of 5120 (the first layer's stride-0 expansion has stride_streams_n = 0, not
    # specialised here), 1024-value tiles.
    types = {"streams_ptr": "*bf16", "kv_ptr": "*bf16", "weight_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32",
             "inv_sqrt_d": "fp32", "stride_streams_t": "i32", "stride_streams_n": "i32", "stride_kv_t": "i32",
             "stride_weight_n": "i32", "stride_out_t": "i32", "stride_out_n": "i32"}
    divisible = {n for n in types if n.endswith("_ptr") or n.startswith("stride")}
    return Case(engram_gate._engram_gate_kernel, types, dict(N_STREAMS=4, HIDDEN=5120, BLOCK_D=1024, PDL=True),
                divisible, 4, 3, options={"launch_pdl": True})


def _record_store(fmt: str, d: int) -> Case:
    # DeepSeek-V4.1's record store: bf16 rows [T, D] (contiguous) to a uint8 record cache.
    types = {"x_ptr": "*bf16", "slot_ptr": "*i64", "cache_ptr": "*u8", "stride_x": "i32",
             "stride_cache_block": "i32", "stride_cache_offset": "i32"}
    block = {"mxfp8": 32, "nvfp4": 16, "mxfp4": 32}[fmt]
    return Case(kv_records._store_records_kernel, types,
                dict(FMT=kv_records.FORMAT_IDS[fmt], HEAD_DIM=d, BLOCK=block, NUM_BLOCKS_P2=d // block,
                     BLOCK_SIZE=16, PDL=True), {"x_ptr", "slot_ptr", "cache_ptr", "stride_x"}, 4, 1,
                options={"launch_pdl": True})


def _v4_moe(t: int) -> fused_moe.MoEConfig:
    return fused_moe.pick_config(t, 6, 256, 4096, 2048)


CASES: dict[str, Callable[[], Case]] = {
    "kv_records_store_mxfp8_D512": lambda: _record_store("mxfp8", 512),
    "kv_records_store_nvfp4_D512": lambda: _record_store("nvfp4", 512),
    "kv_records_store_mxfp4_D128": lambda: _record_store("mxfp4", 128),
    "topk_prefill_N1024_w2": lambda: _topk(1024, 2),
    "indexer_prefill_per_token_N64_w4_s3": lambda: _indexer(1, 64, 4, 3),
    "indexer_prefill_T4_N64_w8_s2": lambda: _indexer(4, 64, 8, 2),
    "indexer_prefill_T4_N64_w8_s3": lambda: _indexer(4, 64, 8, 3),
    "indexer_prefill_T4_N64_w4_s3": lambda: _indexer(4, 64, 4, 3),
    "indexer_prefill_T2_N64_w4_s3": lambda: _indexer(2, 64, 4, 3),
    "indexer_prefill_T4_N64_w16_s3": lambda: _indexer(4, 64, 16, 3),
    "indexer_prefill_T4_N64_w4_s3_records": lambda: _indexer(4, 64, 4, 3, packed=True),
    "indexer_decode_per_token_N64_w4_s3_records": lambda: _indexer(1, 64, 4, 3, packed=True),
    "gluon_sparse_prefill_window_top512_rope": lambda: _gluon_sparse(True, True),
    "gluon_sparse_prefill_window_top512": lambda: _gluon_sparse(True, False),
    "gluon_sparse_prefill_window_rope": lambda: _gluon_sparse(False, True),
    "sparse_prefill_window_top512_N64_s2": lambda: _sparse(True, 64, 2, False),
    "sparse_prefill_window_N64_s2": lambda: _sparse(False, 64, 2, False, scan=128),
    "sparse_prefill_window_top512_N32_s3": lambda: _sparse(True, 32, 3, False),
    "sparse_decode_H16_N16_split": lambda: _sparse(True, 16, 2, True, block_h=16, warps=4, scan=16),
    "sparse_prefill_window_top512_N64_s2_records": lambda: _sparse(True, 64, 2, False, packed=True),
    "sparse_prefill_window_top512_N32_s3_records": lambda: _sparse(True, 32, 3, False, packed=True),
    "sparse_decode_H16_N16_split_records": lambda: _sparse(True, 16, 2, True, block_h=16, warps=4, scan=16,
                                                           packed=True),
    "moe_gate_up_prefill_T4096": lambda: _moe_gate_up(_v4_moe(4096)),
    "moe_gate_up_prefill_T4096_packed": lambda: _moe_gate_up(_v4_moe(4096), packed=True),
    "moe_gate_up_medium_T1024": lambda: _moe_gate_up(_v4_moe(1024)),
    "moe_gate_up_medium_T1024_packed": lambda: _moe_gate_up(_v4_moe(1024), packed=True),
    "moe_gate_up_decode_T1": lambda: _moe_gate_up(_v4_moe(1)),
    "moe_gate_up_decode_T1_packed": lambda: _moe_gate_up(_v4_moe(1), packed=True),
    "moe_down_prefill_T4096": lambda: _moe_down(_v4_moe(4096)),
    "moe_down_prefill_T4096_packed": lambda: _moe_down(_v4_moe(4096), packed=True),
    "moe_down_medium_T1024": lambda: _moe_down(_v4_moe(1024)),
    "moe_down_medium_T1024_packed": lambda: _moe_down(_v4_moe(1024), packed=True),
    "moe_down_decode_T1": lambda: _moe_down(_v4_moe(1)),
    "moe_down_decode_T1_packed": lambda: _moe_down(_v4_moe(1), packed=True),
    "hc_collapse_D4096": lambda: _hc_collapse(False),
    "hc_pre_T256_K64_w8_s3": lambda: _hc_pre(256, 64, 8, 3),
    "hc_pre_T128_K64_w8_s3": lambda: _hc_pre(128, 64, 8, 3),
    "hc_pre_T256_K64_w8_s3_copies": lambda: _hc_pre(256, 64, 8, 3, True),
    "hc_collapse_norm_D4096_copies": lambda: _hc_collapse(True, True),
    "hc_post_D4096": lambda: _hc_post(False),
    "hc_post_D4096_copies": lambda: _hc_post(True),
    "hc_collapse_norm_D4096": lambda: _hc_collapse(True),
    "hc_rms_norm_D4096": _rms_norm_row,
    "v41_engram_gather_C24_E256": _engram_gather,
    "v41_pool_window_r2_D512": _pool_window,
    "v41_candidate_block_max": lambda: _candidate_blocks(False),
    "v41_candidate_keep_blocks": lambda: _candidate_blocks(True),
    "v41_engram_gate_D5120": _engram_gate,
}


def main(prefixes: list[str]) -> None:
    print(f"triton {triton.__version__}, target sm_90")
    for name, make in CASES.items():
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        r = resources(make())
        print(f"{name:40s} regs {r['regs']:3d}  spill {r['spill_bytes']:4d} B  smem {r['smem'] // 1024:3d} KiB  "
              f"async loads {r['async_loads']:2d}  plain loads {r['plain_loads']:2d}")


if __name__ == "__main__":
    main(sys.argv[1:])
