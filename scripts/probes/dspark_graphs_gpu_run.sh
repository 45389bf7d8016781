#!/usr/bin/env bash
# One device call of under ten minutes: model drafters inside the decode CUDA graphs.
# 1. The GPU tests (tests/gpu/test_drafter_graphs.py): DSpark on the embedded model and MTP on a
#    tiny DeepSeek-V3, tokens with graphs equal eager-with-spec in float32, and the step counters
#    show the drafter's steps replayed graphs.
# 2. DeepSeek-V4.1-Flash widths (1 layer, random weights) with the release's DSpark drafter,
#    3 drafts a step, B = 1, 16, 64, with the drafter's graphs (CURVE_MODES="drafter-graphs
#    no-drafter-graphs" adds the eager drafter): bench curve, which takes bench decode's
#    measurement (and report line, with the drafter's graph-step counters) at each B on one
#    engine, so the sweep fits the time (three bench decode runs would build three engines).
# 3. The embedded model's evaluation on the GPU (below).
# JSON and logs go to $OUT; a summary is printed at the end. Worst case ~9 minutes (timeouts):
# on an H100 the whole test file took over 85 s and the curve 126 s (two tests: 45 s).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
git log --oneline -1 >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/gpu/test_drafter_graphs.py \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -15 "$OUT/gpu_tests.log"
BENCH="python3 -m deepinfer.entrypoints.cli bench"
COMMON="--config deepseek-v4.1-flash --num-layers 1 --speculative 3 --spec-method dspark --no-hf --steps 16"
for mode in ${CURVE_MODES:-drafter-graphs}; do
    timeout 180 $BENCH curve $COMMON --batch-sizes 1,16,64 --context-len 1024 --$mode \
        --output-json "$OUT/curve_$mode.json" > "$OUT/curve_$mode.log" 2>&1
    rc=$?
    echo "curve $mode exit $rc"
    if [ $rc -eq 0 ]; then grep -E "^B=[0-9]+: [0-9.]+ ms/step|drafter:" "$OUT/curve_$mode.log" | tail -12
    else tail -25 "$OUT/curve_$mode.log"; fi
done
# 3. The embedded model with its trained drafter, each held-out prompt alone, DSpark against plain
#    decode in one run: tau and per-user speed on the GPU (the drafter's graphs on by default).
timeout 150 python3 scripts/train_dspark_drafter.py --eval-only --eval-device cuda \
    --eval-profile "$OUT/embedded_profile.txt" > "$OUT/embedded_eval.log" 2>&1
echo "embedded eval exit $?"; tail -12 "$OUT/embedded_eval.log"; head -3 "$OUT/embedded_profile.txt" "$OUT/embedded_profile.plain.txt"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for mode in ("drafter-graphs", "no-drafter-graphs"):
    path = out / f"curve_{mode}.json"
    if not path.exists():
        print(f"{mode}: no result"); continue
    for p in json.loads(path.read_text())["points"]:
        s, c = p["spec"], p["spec"]["spec_counters"]
        print(f"{mode:18s} B={p['batch']:3d}: plain {p['engine']['ms_per_step']:.3f} ms, dspark {s['ms_per_step']:.3f} ms "
              f"({s['step_over_plain_step']:.2f}x), drafter graph steps {c['drafter_graph_steps']}/{s['timed_steps']}, "
              f"graph proposals {c['draft_graph_proposals']}, graph verifications {c['graph_verifications']}")
PY
