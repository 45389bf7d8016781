#!/usr/bin/env bash
# Single-GPU figures with the distributed code in place against a tree without it, in one call:
# decode B = 1, 16, 64 (context 4,096) and prefill 4,096 tokens at DeepSeek-V4-Flash widths,
# 4 layers, random weights in bf16 (`--weights bf16` where the tree has the flag), `--no-hf`. BASELINE is a directory holding an older tree's
# `deepinfer/` (e.g. `git archive 5dad53a deepinfer | tar -x -C .baseline`); the current tree is
# the repository root. Logs and JSON go to $OUT; the summary lines are printed.
set -uo pipefail
OUT=${OUT:-out}
BASELINE=${BASELINE:-.baseline}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ROOT=$(pwd)
for tree in baseline current; do
    dir=$ROOT; weights="--weights bf16"
    [ "$tree" = baseline ] && dir=$(cd "$BASELINE" && pwd) && weights=""
    (cd "$dir" && export PYTHONPATH=. &&
     timeout 200 python3 -m deepinfer.entrypoints.cli bench curve --config deepseek-v4-flash --num-layers 4 \
        --batch-sizes 1,16,64 --context-len 4096 --steps ${STEPS:-32} --no-hf $weights \
        --output-json "$OUT/decode_$tree.json" > "$OUT/decode_$tree.log" 2>&1;
     echo "$tree decode exit $?";
     timeout 120 python3 -m deepinfer.entrypoints.cli bench prefill --config deepseek-v4-flash --num-layers 4 \
        --prompt-len 4096 --iters 5 --no-hf $weights \
        --output-json "$OUT/prefill_$tree.json" > "$OUT/prefill_$tree.log" 2>&1;
     echo "$tree prefill exit $?")
    grep -E "B=|ms/step|steady|floor" "$OUT/decode_$tree.log" | tail -6
    grep -E "steady|floor|ms" "$OUT/prefill_$tree.log" | tail -4
done
