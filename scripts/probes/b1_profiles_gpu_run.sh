#!/usr/bin/env bash
# One device call (< 10 min): the B = 1 decode profiles that explain three open costs, then the
# quantised kernels' GPU tests.
#   1. batch-invariant mode at B = 1 (V4-Flash widths, 4 layers, bf16): both modes profiled;
#   2. FP8 + FP4 weights at B = 1: profiled;
#   3. the embedded model with its DSpark drafter against plain decode, each profiled;
#   4. every FP8 GEMM / FP4 MoE kernel test and tests/gpu/test_quant_gpu.py on CUDA.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
BENCH="python3 -m deepinfer.entrypoints.cli bench"
DEC="--config deepseek-v4-flash --num-layers 4 --batch-size 1 --context-len 1024 --steps 16 --no-hf --no-compare-sync"
start=$SECONDS
timeout 130 $BENCH decode $DEC --weights bf16 --batch-invariant --profile "$OUT/profile_b1.txt" > "$OUT/decode_b1_bi.log" 2>&1
echo "invariant B=1 profiles exit $? ($((SECONDS - start)) s)"; grep -E "ms/step|slowdown|invariant" "$OUT/decode_b1_bi.log" | head -6
timeout 90 $BENCH decode $DEC --weights fp8+fp4 --profile "$OUT/profile_b1_fp8fp4.txt" > "$OUT/decode_b1_fp8fp4.log" 2>&1
echo "fp8+fp4 B=1 profile exit $? ($((SECONDS - start)) s)"
timeout 150 python3 scripts/train_dspark_drafter.py --eval-only --eval-device cuda \
    --eval-profile "$OUT/embedded_profile.txt" > "$OUT/embedded_eval.log" 2>&1
echo "embedded eval exit $? ($((SECONDS - start)) s)"; tail -8 "$OUT/embedded_eval.log"
timeout $((560 - (SECONDS - start))) python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_fp4_moe.py tests/gpu/test_quant_gpu.py > "$OUT/quant_tests.log" 2>&1
echo "quant tests exit $? ($((SECONDS - start)) s)"; grep -E "passed|failed|FAILED" "$OUT/quant_tests.log" | tail -8
