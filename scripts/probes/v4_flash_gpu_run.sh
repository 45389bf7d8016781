#!/bin/bash
# The DeepSeek-V4-Flash GPU checks and figures (tests, A/B probes, bench prefill and decode), in two device calls of under ten minutes each.
# Run from the repository root; logs land in $OUT (five files a phase: the device returns eight).
#
#   bash scripts/probes/v4_flash_gpu_run.sh check    # GPU tests, A/B probes, bench prefill, profile (<10 min)
#   bash scripts/probes/v4_flash_gpu_run.sh decode   # bench decode at B=1, 16, 64; prefill of 2 prompts a step
#
# `check` first runs the GPU tests of the changes made since the last timed run (an untimed
# change that fails them is reverted, not tuned), then times them against their alternatives
# in one process, then takes the prefill figure. A candidate Gluon attention kernel can travel
# as .whl/candidate_gluon.py (carry [".whl"]), e.g. the source-continuation gather pipeline:
#   mkdir -p .whl && git show 7c52ce4:deepinfer/kernels/sparse_attention_gluon.py > .whl/candidate_gluon.py
# It is checked against the reference and timed against the tree's kernel; nothing is swapped.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/v4_flash_gpu}
mkdir -p "$OUT"
phase=${1:-check}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
step() { echo; echo "=== [$(elapsed) s] $*"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
    > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

case "$phase" in
check)
    step "GPU tests (log: tests.log)"
    # Every test of these files, the CPU-marked ones too (they take the CUDA device when there is one).
    timeout 270 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/gpu \
        tests/kernels/test_sparse_attention_gluon.py tests/kernels/test_hyper_connection.py \
        tests/kernels/test_compressor.py tests/kernels/test_greedy.py tests/unit/test_sampler.py \
        > "$OUT/tests.log" 2>&1
    echo "pytest exit $?"; tail -15 "$OUT/tests.log"

    step "A/B probes (log: probes.log)"
    {
        echo "--- first connection: written stream copies vs the stride-0 view"
        timeout 90 python3 scripts/probes/stream_copies_ab.py
        echo "--- Gluon attention: tree vs candidate"
        if [ -f .whl/candidate_gluon.py ]; then
            timeout 150 python3 scripts/probes/gluon_attention_ab.py .whl/candidate_gluon.py
        else
            echo "no .whl/candidate_gluon.py carried: tree kernel alone"
            timeout 90 python3 scripts/probes/gluon_attention_ab.py
        fi
    } > "$OUT/probes.log" 2>&1
    tail -30 "$OUT/probes.log"

    step "bench prefill (json: prefill.json)"
    timeout 200 python3 -m deepinfer.entrypoints.cli bench prefill --config deepseek-v4-flash \
        --prompt-len 4096 --no-hf --iters 10 --output-json "$OUT/prefill.json" 2>&1 | tail -12
    if [ "$(elapsed)" -lt 400 ]; then
        # With PDL on, the profiler charges each kernel with part of the previous one's run.
        step "profile of one prefill round, PDL off (prefill_profile.txt)"
        DEEPINFER_PDL=0 timeout $((560 - $(elapsed))) python3 -m deepinfer.entrypoints.cli bench prefill \
            --config deepseek-v4-flash --prompt-len 4096 --no-hf --iters 3 \
            --profile "$OUT/prefill_profile.txt" 2>&1 | tail -3
        head -45 "$OUT/prefill_profile.txt" | cut -c1-110
    fi
    ;;
decode)
    for b in 1 16 64; do
        step "bench decode B=$b (json: decode_b$b.json)"
        timeout 170 python3 -m deepinfer.entrypoints.cli bench decode --config deepseek-v4-flash \
            --context-len 1024 --steps 32 --batch-size "$b" --no-hf \
            --output-json "$OUT/decode_b$b.json" 2>&1 | tail -10
    done
    if [ "$(elapsed)" -lt 420 ]; then
        # Not the headline figure (one 4,096-token prompt): two prompts a step, 8,192 tokens, so
        # each routed expert's weights serve ~192 rows instead of ~96. Reported beside it only.
        step "bench prefill, two 4,096-token prompts a step (prefill_b2.json; informative)"
        timeout $((570 - $(elapsed))) python3 -m deepinfer.entrypoints.cli bench prefill \
            --config deepseek-v4-flash --prompt-len 4096 --batch-size 2 --max-num-batched-tokens 8192 \
            --no-hf --iters 6 --output-json "$OUT/prefill_b2.json" 2>&1 | tail -8
    fi
    ;;
*)
    echo "unknown phase '$phase': check or decode" >&2
    exit 2
    ;;
esac
step "done"
