"""Instructions a weight in the FP4 MoE kernels' K loops (kernels/fp4_moe.py), from their sm_90
SASS compiled without a GPU (Triton's bundled ptxas and cuobjdump, as
``scripts/probes/sm90_resources.py``), at DeepSeek-V4-Flash's decode (T=1) and prefill (T=4096)
tiles with UE8M0 scales: the dequant path and the group path's variants.

The K loop is the longest backward branch of the kernel; its body's instruction count divided by
the weights each thread decodes a K step is the ALU/LSU cost a weight that decode's memory rate
has to hide (the instruction mix shows where it goes). Not a timing: see
``scripts/probes/fp4_moe_variants.py`` on the device.

    python scripts/probes/fp4_moe_sass.py
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.argv = sys.argv[:1] + ["none"]          # quant_sm90_resources: build its cases, compile none

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import quant_sm90_resources as cases  # noqa: E402
from sm90_resources import Case, _cuobjdump  # noqa: E402

from deepinfer.kernels.fp4_moe import FP4Kernel, fp4_pick_config  # noqa: E402

_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass(case: Case) -> str:
    names = case.kernel.arg_names
    signature = {n: case.types.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.divisible}
    compiled = triton.compile(ASTSource(case.kernel, signature, dict(case.constants), attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=case.num_warps, num_stages=case.num_stages, **case.options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_body(text: str) -> collections.Counter:
    """Opcode counts between the target and the source of the longest backward branch."""
    rows = [(int(m.group(1), 16), m.group(2), line) for line in text.splitlines() if (m := _ADDR.search(line))]
    best = (0, -1)
    for addr, op, line in rows:
        target = re.search(r"BRA [^;]*0x([0-9a-f]+)", line) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    return collections.Counter(op for addr, op, _ in rows if best[0] <= addr <= best[1])


VARIANTS = [("dequant", None), ("bf16 g1 dot", FP4Kernel(groups=1)), ("bf16 g2 dot", FP4Kernel(groups=2)),
            ("bf16 g2 dot noasm", FP4Kernel(groups=2, asm=False)), ("bf16 g2 weight", FP4Kernel(scale="weight")),
            ("bf16 g2 weight wide", FP4Kernel(scale="weight", wide=True)),
            ("bf16 g4 weight wide", FP4Kernel(groups=4, scale="weight", wide=True)),
            ("bf16 g2 weight split", FP4Kernel(scale="weight", wide=True, split=True)),
            ("bf16 g4 weight split", FP4Kernel(groups=4, scale="weight", wide=True, split=True)),
            ("fp8 g2", FP4Kernel(dot="fp8"))]

for t in (1, 4096):
    cfg = fp4_pick_config(t, 6, 256, 4096, 2048)
    for name, kern in VARIANTS:
        for proj, block_n in (("gate_up", cfg.block_n1), ("down", cfg.block_n2)):
            if kern is None:
                case = (cases.gate_up if proj == "gate_up" else cases.down)(cfg)
                step = cfg.block_k1 if proj == "gate_up" else cfg.block_k2
            else:
                case = (cases.group_gate_up if proj == "gate_up" else cases.group_down)(cfg, kern)
                step = 32 * kern.groups
            ops = loop_body(sass(case))
            weights = block_n * step * (2 if proj == "gate_up" else 1) // (cfg.num_warps * 32)   # a thread's, a step
            total = sum(ops.values())
            mix = ", ".join(f"{k}:{v}" for k, v in ops.most_common(8))
            print(f"T={t:5d} {proj:7s} {name:20s} {total:5d} instr / {weights:3d} weights = {total / weights:5.2f}  [{mix}]",
                  flush=True)
