#!/usr/bin/env bash
# One device call of under ten minutes: `bench multiturn` (prefix caching on and off, a
# warm-up of the whole workload first) and `bench curve --speculative 3` (plain decode and
# verification steps of 1 + 3 tokens per request, fixed drafts) at DeepSeek-V4-Flash widths,
# 4 layers. Logs and JSON go to $OUT; summaries are printed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
BENCH="python3 -m deepinfer.entrypoints.cli bench"
timeout 230 $BENCH multiturn --config deepseek-v4-flash --num-layers 4 \
    --output-json "$OUT/multiturn_v4flash.json" > "$OUT/multiturn_v4flash.log" 2>&1
echo "multiturn exit $?"; tail -14 "$OUT/multiturn_v4flash.log"
timeout 330 $BENCH curve --config deepseek-v4-flash --num-layers 4 --batch-sizes 1,16,64 --speculative 3 \
    --no-hf --output-json "$OUT/curve_spec_v4flash.json" > "$OUT/curve_spec_v4flash.log" 2>&1
echo "curve exit $?"; tail -24 "$OUT/curve_spec_v4flash.log"
