#!/usr/bin/env bash
# The DeepSeek-V4-Flash benchmark set of docs/BENCHMARKS.md on one GPU, in one go:
# decode B=1 and B=16 (with HF transformers in the same process), decode B=64, the decode
# curve 1..256 (JSON + PNG), and a 4,096-token prefill (round and steady, with HF).
#
#   bash scripts/bench_v4flash.sh OUT_DIR [LAYERS]
#
# OUT_DIR receives one JSON per figure (and curve.png); LAYERS (default 4) is the number of
# decoder layers at V4-Flash widths. HF transformers >= 5.23 must import for the HF columns
# (5.17 fails on deepseek_v4 in bf16); without it, add --no-hf to the commands by hand.
set -euo pipefail
out=${1:?usage: bash scripts/bench_v4flash.sh OUT_DIR [LAYERS]}
layers=${2:-4}
mkdir -p "$out"
bench() { python3 -m deepinfer.entrypoints.cli bench "$@"; }
common=(--config deepseek-v4-flash --num-layers "$layers")
decode=(decode "${common[@]}" --context-len 1024 --steps 32)

bench "${decode[@]}" --batch-size 1 --output-json "$out/decode_b1.json"
bench "${decode[@]}" --batch-size 16 --output-json "$out/decode_b16.json"
bench "${decode[@]}" --batch-size 64 --no-hf --output-json "$out/decode_b64.json"
bench curve "${common[@]}" --context-len 1024 --batch-sizes 1,2,4,8,16,32,64,128,256 --no-hf \
    --output-json "$out/curve.json" --output-png "$out/curve.png"
bench prefill "${common[@]}" --prompt-len 4096 --output-json "$out/prefill.json"
