#!/usr/bin/env bash
# One device call (< 10 min) for the figures two issues record, at DeepSeek-V4-Flash widths on 4
# layers, random weights:
#   1. the batch-invariant mode's cost (bf16; each process times the normal mode, then the mode):
#      decode at B = 1, 16, 64 (context 1,024) and prefill of 4,096 tokens;
#   2. the weights as shipped (FP8 + FP4 experts): decode B = 1 profiled with programmatic
#      dependent launch off (kernels by device time, launches a step), then prefill of 4,096
#      tokens against its per-part floor.
# Each step is skipped once the call has used 520 s. Logs and JSON go to $OUT; summaries printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/gpu.txt"
BENCH="python3 -m deepinfer.entrypoints.cli bench"
V4="--config deepseek-v4-flash --num-layers 4 --no-hf"
start=$SECONDS
left() { echo $((520 - (SECONDS - start))); }
step() {   # step NAME SECONDS CMD...: run CMD under min(SECONDS, time left), log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local budget; budget=$(left)
    [ "$budget" -lt 30 ] && { echo "$name: skipped (time)"; return; }
    [ "$limit" -gt "$budget" ] && limit=$budget
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $? ($((SECONDS - start)) s)"
}
step invariant_decode 170 $BENCH curve $V4 --weights bf16 --batch-invariant --batch-sizes 1,16,64 \
    --context-len 1024 --warmup 2 --steps 8 --output-json "$OUT/invariant_decode.json"
grep -E "^B=[0-9]+: " "$OUT/invariant_decode.log" | head -6
step invariant_prefill 90 $BENCH prefill $V4 --weights bf16 --batch-invariant --prompt-len 4096 --warmup 1 \
    --iters 2 --output-json "$OUT/invariant_prefill.json"
grep -E "batch-invariant mode" "$OUT/invariant_prefill.log" | head -2
step quant_b1_profile 100 env DEEPINFER_PDL=0 $BENCH decode $V4 --weights fp8+fp4 --batch-size 1 \
    --context-len 1024 --steps 16 --no-compare-sync --profile "$OUT/profile_b1_fp8fp4.txt"
grep -E "ms/step|floor" "$OUT/quant_b1_profile.log" | head -4; head -30 "$OUT/profile_b1_fp8fp4.txt" 2>/dev/null
step quant_prefill 120 $BENCH prefill $V4 --weights fp8+fp4 --prompt-len 4096 --warmup 1 --iters 3 \
    --output-json "$OUT/quant_prefill.json"
grep -iE "steady|floor" "$OUT/quant_prefill.log" | head -8
echo "total $((SECONDS - start)) s"
