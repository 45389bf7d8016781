#!/usr/bin/env bash
# One device call of under ten minutes: the embedded model's trained DSpark drafter on the
# GPU (held-out tau, acceptance, per-user speed with and without it); verification steps of
# 1 + 3 tokens (fixed drafts, through the decode CUDA graphs) against plain decode at
# DeepSeek-V4-Flash widths (4 layers); and DeepSeek-V4.1-Flash widths (1 layer, random
# weights) with the release's DSpark drafter, at B = 1, 16, 64. JSON and logs go to $OUT.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
git log --oneline -1 >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 120 python3 scripts/train_dspark_drafter.py --eval-only --eval-device cuda \
    --eval-json "$OUT/dspark_embedded_cuda.json" > "$OUT/dspark_embedded_cuda.log" 2>&1
echo "embedded eval exit $?"; tail -12 "$OUT/dspark_embedded_cuda.log"
BENCH="python3 -m deepinfer.entrypoints.cli bench"
timeout 250 $BENCH curve --config deepseek-v4-flash --num-layers 4 --batch-sizes 1,16,64 --speculative 3 \
    --no-hf --output-json "$OUT/curve_v4_fixed.json" > "$OUT/curve_v4_fixed.log" 2>&1
echo "curve v4 fixed exit $?"; tail -16 "$OUT/curve_v4_fixed.log"
timeout 200 $BENCH curve --config deepseek-v4.1-flash --num-layers 1 --batch-sizes 1,16,64 --speculative 3 \
    --spec-method dspark --no-hf --output-json "$OUT/curve_v41_dspark.json" > "$OUT/curve_v41_dspark.log" 2>&1
echo "curve v41 dspark exit $?"; tail -16 "$OUT/curve_v41_dspark.log"
