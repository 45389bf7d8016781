#!/usr/bin/env bash
# Quantised weights on the GPU, in two device calls of under ten minutes each:
#   PART=1: every FP8 GEMM and FP4 MoE kernel test on CUDA (V4-Flash widths, both scale formats,
#      the grouped o_a GEMM; the kernel tests marked gpu took 89 s on an H100), the tiny model
#      quantised at load on CUDA against the same model on the CPU, then decode at
#      DeepSeek-V4-Flash widths, 4 layers, B = 1, 16, 64, with the weights as shipped
#      (--weights fp8+fp4) and in bf16, one engine per format (`bench curve`), the first with a
#      B = 1 profile (`bench decode --profile`).
#   PART=2: the FP4 MoE's variants at 4,096 tokens (scripts/probes/fp4_moe_variants.py) and
#      prefill of 4,096 tokens in both formats (the issue's prefill target).
# Logs and JSON go to $OUT; summaries are printed. Without a GPU (no nvidia-smi) it dry-runs the
# kernel tests in Triton's interpreter and `bench decode` on a tiny DeepSeek-V4 config with the
# V4.1 release's formats.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
BENCH="python3 -m deepinfer.entrypoints.cli bench"
KERNEL_TESTS="tests/kernels/test_fp8_gemm.py tests/kernels/test_fp4_moe.py"
GPU_TESTS="$KERNEL_TESTS tests/gpu/test_quant_gpu.py"

if command -v nvidia-smi > /dev/null && nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
    cat "$OUT/gpu.txt"
    PART=${PART:-1}
    if [ "$PART" = 1 ]; then
    timeout 200 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests exit $?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -8
    for weights in fp8+fp4 bf16; do
        timeout 150 $BENCH curve --config deepseek-v4-flash --num-layers 4 --weights "$weights" \
            --batch-sizes 1,16,64 --context-len 1024 --steps 16 --no-hf \
            --output-json "$OUT/decode_v4flash_$weights.json" > "$OUT/decode_v4flash_$weights.log" 2>&1
        echo "decode --weights $weights exit $?"; grep -E "^B=[0-9]+: [0-9.]+ ms/step" "$OUT/decode_v4flash_$weights.log"
    done
    timeout 90 $BENCH decode --config deepseek-v4-flash --num-layers 4 --weights fp8+fp4 --batch-size 1 \
        --context-len 1024 --steps 16 --no-hf --no-compare-sync --profile "$OUT/profile_b1_fp8fp4.txt" \
        > "$OUT/decode_b1.log" 2>&1
    echo "decode B=1 profile exit $?"; head -12 "$OUT/profile_b1_fp8fp4.txt"
    else
    PROBE_TOKENS=4096 PROBE_BUDGET_S=60 timeout 100 python3 scripts/probes/fp4_moe_variants.py \
        > "$OUT/fp4_moe_prefill.log" 2>&1
    echo "fp4 moe prefill variants exit $?"; grep -E "^T=|BEST" "$OUT/fp4_moe_prefill.log" | head -20
    for weights in fp8+fp4 bf16; do
        timeout 150 $BENCH prefill --config deepseek-v4-flash --num-layers 4 --weights "$weights" --prompt-len 4096 \
            --warmup 1 --iters 3 --no-hf --output-json "$OUT/prefill_$weights.json" > "$OUT/prefill_$weights.log" 2>&1
        echo "prefill --weights $weights exit $?"; grep -iE "steady|floor|ms" "$OUT/prefill_$weights.log" | head -6
    done
    fi
else
    echo "no GPU: dry run on the CPU"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    timeout 300 python3 -m pytest -q $KERNEL_TESTS > "$OUT/cpu_tests.log" 2>&1
    echo "interpreter tests exit $?"; tail -3 "$OUT/cpu_tests.log"
    python3 - "$OUT/tiny_v4_config.json" <<'PY'
import json, sys
from tests import TINY_V4_MODEL
cfg = json.load(open(f"{TINY_V4_MODEL}/config.json"))
cfg["quantization_config"] = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                              "expert_dtype": "fp4"}
json.dump(cfg, open(sys.argv[1], "w"))
PY
    for weights in fp8+fp4 bf16; do
        timeout 120 $BENCH decode --config "$OUT/tiny_v4_config.json" --num-layers 2 --device cpu --weights "$weights" \
            --batch-size 2 --context-len 16 --steps 2 --warmup 1 --no-hf --no-compare-sync \
            --floor-copy-mib 8 --floor-matmul-n 128 \
            --output-json "$OUT/decode_tiny_$weights.json" > "$OUT/decode_tiny_$weights.log" 2>&1
        echo "decode --weights $weights exit $?"; grep -E "B=|weights" "$OUT/decode_tiny_$weights.log" | tail -4
    done
fi
