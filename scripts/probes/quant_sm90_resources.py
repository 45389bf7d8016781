"""Registers, spills, shared memory and asynchronous loads of the FP8 GEMM and FP4 MoE kernels
compiled for sm_90 without a GPU (``scripts/probes/sm90_resources.py`` does the compiling), at
DeepSeek-V4-Flash shapes: the activation quantisation, the FP8 GEMM's decode and prefill tiles
with 128 x 128 float32 and 32 x 32 UE8M0 weight scales (also quantising its activations itself
and split K), the FP4 MoE's gate_up and down configs at T = 1, 64, 4096 (the dequant path, and
the group path with bf16 and FP8 dots).

    python scripts/probes/quant_sm90_resources.py          # every case
    python scripts/probes/quant_sm90_resources.py fp4      # cases whose name starts so
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sm90_resources import Case, resources  # noqa: E402

from deepinfer.kernels import fp4_moe, fp8_gemm  # noqa: E402
from deepinfer.kernels.fp4_moe import fp4_pick_config  # noqa: E402


def gemm(bm: int, bn: int, warps: int, stages: int, bk: int = 128, e8m0: bool = False, split: int = 1) -> Case:
    # Weight scales: float32 per 128 x 128, or UE8M0 bytes per bk x bk; split: K in ``split`` slices
    # summed by each tile's last program.
    types = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32",
             "w_ptr": "*fp8e4nv", "ws_ptr": "*u8" if e8m0 else "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32", "m": "i32", "n": "i32", "k": "i32", "stride_a": "i32", "stride_as": "i32",
             "stride_w": "i32", "stride_ws": "i32", "stride_out": "i32", "stride_part": "i32"}
    div = {"a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "part_ptr", "count_ptr", "n", "k", "stride_a",
           "stride_w", "stride_out"}
    return Case(fp8_gemm._gemm_kernel, types, dict(GROUP=128, WBN=bk, WBK=bk, W_E8M0=e8m0, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=min(128, bk), SPLIT=split, PDL=True), div, warps, stages,
                options={"launch_pdl": True})


def act_quant(pow2: bool) -> Case:
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "stride_x": "i32",
             "stride_q": "i32", "stride_s": "i32"}
    return Case(fp8_gemm._act_quant_kernel, types, dict(GROUP=128, POW2=pow2, PDL=True),
                {"x_ptr", "q_ptr", "s_ptr", "stride_x", "stride_q"}, 1, 1, options={"launch_pdl": True})


def gate_up(cfg: fp4_moe.MoEConfig, e8m0: bool = True) -> Case:
    types = {"x": "*bf16", "wq": "*u8", "ws": "*u8" if e8m0 else "*fp32", "act_ptr": "*bf16", "sorted_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "num_pairs": "i32", "hidden": "i32", "inter": "i32",
             "num_pid_m": "i32", "limit": "fp32", "stride_x": "i32", "stride_qe": "i32", "stride_qn": "i32",
             "stride_se": "i32", "stride_sn": "i32", "stride_act": "i32"}
    div = {"x", "wq", "ws", "act_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "hidden", "inter",
           "stride_x", "stride_qe", "stride_qn", "stride_se", "stride_act"}
    return Case(fp4_moe._fp4_gate_up_kernel, types, dict(TOP_K=6, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1,
                BLOCK_K=cfg.block_k1, GROUP_M=cfg.group_m, HAS_LIMIT=True, S_E8M0=e8m0, DOT_PRECISION="tf32", PDL=True),
                div, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


def down(cfg: fp4_moe.MoEConfig, e8m0: bool = True) -> Case:
    types = {"act": "*bf16", "wq": "*u8", "ws": "*u8" if e8m0 else "*fp32", "out_ptr": "*bf16", "weights_ptr": "*fp32",
             "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "num_pairs": "i32",
             "hidden": "i32", "inter": "i32", "num_pid_m": "i32", "stride_act": "i32", "stride_qe": "i32",
             "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_out": "i32"}
    div = {"act", "wq", "ws", "out_ptr", "weights_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "hidden",
           "inter", "stride_act", "stride_qe", "stride_qn", "stride_se", "stride_out"}
    return Case(fp4_moe._fp4_down_kernel, types, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
                GROUP_M=cfg.group_m, S_E8M0=e8m0, DOT_PRECISION="tf32", PDL=True),
                div, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


def group_gate_up(cfg: fp4_moe.MoEConfig, kern: fp4_moe.FP4Kernel, e8m0: bool = True) -> Case:
    fp8 = kern.dot == "fp8"
    types = {"x": "*fp8e4nv" if fp8 else "*bf16", "xs": "*fp32" if fp8 else "*bf16", "wq": "*u8",
             "ws": "*u8" if e8m0 else "*fp32", "act_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "num_pairs": "i32", "hidden": "i32", "inter": "i32", "num_pid_m": "i32",
             "limit": "fp32", "stride_x": "i32", "stride_xs": "i32", "stride_qe": "i32", "stride_qn": "i32",
             "stride_se": "i32", "stride_sn": "i32", "stride_act": "i32"}
    div = {"x", "xs", "wq", "ws", "act_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "hidden", "inter",
           "stride_x", "stride_xs", "stride_qe", "stride_qn", "stride_se", "stride_sn", "stride_act"}
    return Case(fp4_moe._fp4g_gate_up_kernel, types, dict(TOP_K=6, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1,
                G=kern.groups, ACT_GROUP=kern.act_group, GROUP_M=cfg.group_m, HAS_LIMIT=True, S_E8M0=e8m0,
                FP8=fp8, SCALE_W=0 if kern.scale == "dot" else 2, WIDE=kern.wide, SPLIT=kern.split, ASM=kern.asm, DOT_PRECISION="tf32",
                PDL=True),
                div, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


def group_down(cfg: fp4_moe.MoEConfig, kern: fp4_moe.FP4Kernel, e8m0: bool = True) -> Case:
    fp8 = kern.dot == "fp8"
    types = {"act": "*fp8e4nv" if fp8 else "*bf16", "act_s": "*fp32" if fp8 else "*bf16", "wq": "*u8",
             "ws": "*u8" if e8m0 else "*fp32", "out_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "num_pairs": "i32", "hidden": "i32",
             "inter": "i32", "num_pid_m": "i32", "stride_act": "i32", "stride_as": "i32", "stride_qe": "i32",
             "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_out": "i32"}
    div = {"act", "act_s", "wq", "ws", "out_ptr", "weights_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr",
           "hidden", "inter", "stride_act", "stride_as", "stride_qe", "stride_qn", "stride_se", "stride_out"}
    return Case(fp4_moe._fp4g_down_kernel, types, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, G=kern.groups,
                ACT_GROUP=kern.act_group, GROUP_M=cfg.group_m, S_E8M0=e8m0, FP8=fp8,
                SCALE_W=0 if kern.scale == "dot" else 2, WIDE=kern.wide, SPLIT=kern.split, ASM=kern.asm,
                DOT_PRECISION="tf32", PDL=True),
                div, cfg.num_warps, cfg.num_stages, options={"launch_pdl": True})


cases = {"act_quant": act_quant(False), "act_quant_pow2": act_quant(True), "gemm_dec": gemm(16, 32, 4, 4),
         "gemm_dec64": gemm(64, 64, 4, 4), "gemm_pre": gemm(128, 128, 8, 3),
         "gemm_pre_32": gemm(128, 128, 8, 3, bk=32, e8m0=True), "gemm_dec_32": gemm(16, 32, 4, 4, bk=32, e8m0=True),
         "gemm_dec_split": gemm(16, 32, 4, 4, split=8),
         "gemm_dec64_split_32": gemm(64, 32, 4, 4, bk=32, e8m0=True, split=4)}
for t in (1, 64, 4096):
    cfg = fp4_pick_config(t, 6, 256, 4096, 2048)
    cases[f"fp4_gate_up_T{t}"] = gate_up(cfg)
    cases[f"fp4_down_T{t}"] = down(cfg)
    for kern in (fp4_moe.FP4Kernel(groups=1), fp4_moe.FP4Kernel(groups=2), fp4_moe.FP4Kernel(groups=2, asm=False),
                 fp4_moe.FP4Kernel(groups=1, scale="weight"), fp4_moe.FP4Kernel(groups=2, scale="weight"),
                 fp4_moe.FP4Kernel(groups=2, scale="weight", wide=True),
                 fp4_moe.FP4Kernel(groups=4, scale="weight", wide=True),
                 fp4_moe.FP4Kernel(groups=2, scale="weight", wide=True, split=True), fp4_moe.FP4Kernel(dot="fp8", groups=2)):
        name = (f"{kern.dot}_g{kern.groups}_{kern.scale}{'_wide' if kern.wide else ''}{'_split' if kern.split else ''}"
                f"{'_asm' if kern.asm else ''}_T{t}")
        cases[f"fp4g_gate_up_{name}"] = group_gate_up(cfg, kern)
        cases[f"fp4g_down_{name}"] = group_down(cfg, kern)
for name, case in cases.items():
    if len(sys.argv) > 1 and not name.startswith(sys.argv[1]):
        continue
    print(name, resources(case), flush=True)
