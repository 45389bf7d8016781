#!/usr/bin/env bash
# One device call (under ten minutes) that first decides issue-level checks, then measures the
# weights as shipped (FP8 + FP4 experts) at DeepSeek-V4-Flash widths, 4 layers, random weights:
#   1. the tiny V4 DSpark engine's seeded tokens with the drafter's CUDA graphs against eager in
#      the batch-invariant mode (cuda_only_faults_gpu_run.sh QUICK=1); if it fails, the seeded
#      probe (scripts/probes/v4_dspark_seeded_graphs.py: logprobs, draft and acceptance counts,
#      PDL off, side streams off);
#   2. the kernels that quantise FP8 linears' inputs in their own launch, and the FP8 GEMM with
#      given codes and a residual, on CUDA;
#   3. decode at B = 1, 16, 64 (context 1,024) against the floors (`bench curve`);
#   4. prefill of 4,096 tokens against its per-part floor (`bench prefill`);
#   5. in the time left, the FP4 MoE's decode variants (tiles, stages, prefetch, float32 scale
#      products; scripts/probes/fp4_moe_variants.py).
# CALL_BUDGET (seconds, default 560) bounds the whole call. Logs and JSON go to $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
BUDGET=${CALL_BUDGET:-560}
S=$SECONDS
BENCH="python3 -m deepinfer.entrypoints.cli bench"
V4="--config deepseek-v4-flash --num-layers 4 --no-hf --weights fp8+fp4"
QUICK=1 OUT=$OUT bash scripts/probes/cuda_only_faults_gpu_run.sh
tail -3 "$OUT/drafter_graphs.log"
if ! grep -q " passed" "$OUT/drafter_graphs.log" || grep -q "failed" "$OUT/drafter_graphs.log"; then
    timeout 120 python3 scripts/probes/v4_dspark_seeded_graphs.py > "$OUT/seeded.log" 2>&1
    grep -E "^--|^==|spec_|differs|equal" "$OUT/seeded.log" | tail -50
fi
echo "== $((SECONDS - S)) s"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rms_norm.py tests/kernels/test_activation.py \
    tests/kernels/test_hyper_connection.py tests/kernels/test_fp8_gemm.py -k "fp8_output or quantized_input" 2>&1 | tail -3
echo "== $((SECONDS - S)) s"
timeout 170 $BENCH curve $V4 --batch-sizes 1,16,64 --context-len 1024 --steps 16 \
    --output-json "$OUT/curve_fp8fp4.json" > "$OUT/curve.log" 2>&1
grep -E "^B=|floor" "$OUT/curve.log" | head -12
echo "== $((SECONDS - S)) s"
timeout 110 $BENCH prefill $V4 --prompt-len 4096 --warmup 1 --iters 3 \
    --output-json "$OUT/prefill_fp8fp4.json" > "$OUT/prefill.log" 2>&1
grep -iE "steady|floor" "$OUT/prefill.log" | head -12
echo "== $((SECONDS - S)) s"
left=$((BUDGET - (SECONDS - S)))
if [ "$left" -gt 40 ]; then
    PROBE_TOKENS=1,16,64 PROBE_MATCH=bits,weight32 PROBE_BUDGET_S=$((left - 30)) OUT=$OUT timeout "$left" \
        python3 scripts/probes/fp4_moe_variants.py 2>&1 | grep -E "T=|BEST" | tail -70
fi
echo "== $((SECONDS - S)) s"
