#!/usr/bin/env bash
# The batch-invariant mode with programmatic dependent launch on and off (DEEPINFER_PDL=1 / 0):
# prefill of 4,096 tokens and decode at B = 1 (context 1,024), DeepSeek-V4-Flash widths, 4 layers,
# bf16, each process timing the normal mode and then the batch-invariant mode. About 4 minutes on
# an H100. Logs go to $OUT; the slowdown lines are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
BENCH="python3 -m deepinfer.entrypoints.cli bench"
COMMON="--config deepseek-v4-flash --num-layers 4 --weights bf16 --no-hf --batch-invariant"
for pdl in 1 0; do
    DEEPINFER_PDL=$pdl timeout 100 $BENCH prefill $COMMON --prompt-len 4096 --warmup 1 --iters 2 \
        --output-json "$OUT/prefill_pdl$pdl.json" > "$OUT/prefill_pdl$pdl.log" 2>&1
    echo "PDL=$pdl prefill 4096 exit $?: $(grep -E "batch-invariant mode" "$OUT/prefill_pdl$pdl.log" | head -1)"
    DEEPINFER_PDL=$pdl timeout 100 $BENCH decode $COMMON --batch-size 1 --context-len 1024 --warmup 4 --steps 16 \
        --no-compare-sync --output-json "$OUT/decode_b1_pdl$pdl.json" > "$OUT/decode_b1_pdl$pdl.log" 2>&1
    echo "PDL=$pdl decode B=1 exit $?: 
        $(grep -iE "invariant|ms/step" "$OUT/decode_b1_pdl$pdl.log" | head -4)"
done
