#!/usr/bin/env bash
# Every check sgrpo needs from a GPU, in priority order, each under its own time limit (~21 minutes in all:
# a 15-minute lease runs the first parts; the logs of those that ran come back). Logs go to $OUT (default gpu_logs/), one file per part, and
# a summary of their last lines to $OUT/summary.txt. Runs with the machine's python3 (or $PY); on a
# machine without registry access, bring the missing wheels in .whl/ (docs/scaling.md, "A GPU session").
#   OUT=/path/to/logs bash benchmarks/gpu_session.sh
#   DRY_RUN=1 OUT=/tmp/dry bash benchmarks/gpu_session.sh   # every part at toy size on CPU: the script itself checked
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
date -u +"GPU session %Y-%m-%dT%H:%MZ" | tee "$OUT/summary.txt"
nvidia-smi -L 2>&1 | tee -a "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...: run, log, and record the exit status and the last lines
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    printf '\n## %s: exit %s in %ss\n' "$name" "$status" "$((SECONDS - started))" >>"$OUT/summary.txt"
    grep -v -i "warn" "$OUT/$name.log" | tail -n 15 >>"$OUT/summary.txt"
}

SCALE=1
if [[ ${DRY_RUN:-0} == 1 ]]; then  # the same parts at toy size on CPU (no CUDA graphs there: eager steps)
    SCALE=4  # a shared CPU machine imports slowly: longer limits
    QUICK=(--trainer.accelerator=cpu --trainer.max_steps=2)
    SMOKE=(--tiny --cpu)
    HEAD=(--device cpu --tiny --repeats 2)
    BENCH=(--device cpu --prompts 2 --group-size 2 --new-tokens 8 --force-length --hidden 64 --layers 2 --heads 2
        --intermediate 128 --warmup 0 --steps 2 --no-publish)  # the committed CPU reports stay as they are
    PACK=(--quick --precision bf16-mixed --no-publish)
else
    QUICK=(--trainer.accelerator=gpu)
    SMOKE=()
    HEAD=()
    BENCH=(--device cuda --prompts 16 --group-size 8 --new-tokens 256 --force-length --hidden 1024 --layers 24
        --heads 16 --intermediate 4096 --warmup 1 --steps 3)
    PACK=(--device cuda --repeats 2)
fi

# 1. correctness and the training step on CUDA: the quickstart (it crashed at step 1 before the device fix)
part quickstart 150 "$PY" -m sgrpo.fit --config configs/quickstart.yaml "${QUICK[@]}" \
    --trainer.default_root_dir="$OUT/quickstart" --trainer.enable_progress_bar=false
# 2. issue 34's length-skewed workloads on the GPU: padded against packed (and prompt-shared) update log-probs, 0.4B
#    in bf16-mixed, the trainer's packed attention (flex or flash-attention); a row per workload as it finishes
part packing 240 "$PY" benchmarks/packing.py "${PACK[@]}"
# 3. where sgrpo's step goes on the GPU (its update took 1.6-3.6x TRL's on 2026-12-04): the phases, each charged
#    with its own kernels, and the update's top kernels by GPU time
part profile 150 "$PY" benchmarks/throughput.py --case profile "${BENCH[@]}" --sgrpo-cuda-graphs
# 4. the 0.44B smoke: decoders (greedy agreement, CUDA-graph steps, graphs kept across rollouts, tokens/s), then
#    FSDP2 fits
part gpu_smoke 300 "$PY" benchmarks/gpu_smoke.py "${SMOKE[@]}"
# 5. the LM head's bf16 path (torch.mm out_dtype=float32, one GEMM) against float32 at a 1.5B model's head:
#    seconds, memory, log-prob differences, the sampler-trainer gap
part head_dtype 60 "$PY" benchmarks/head_dtype.py "${HEAD[@]}"
# 6. sgrpo vs TRL on one GPU, forced length, bf16-mixed: eager decode, then CUDA-graph decode steps
part throughput 200 "$PY" benchmarks/throughput.py "${BENCH[@]}"
part throughput_graphs 150 "$PY" benchmarks/throughput.py "${BENCH[@]}" --sgrpo-cuda-graphs
# the throughput reports published on this machine (benchmarks/artefact.py) come back with the logs
for report in benchmarks/reports/throughput*cuda* benchmarks/reports/packing_cuda; do
    [[ -d $report && ${DRY_RUN:-0} != 1 ]] && cp -r "$report" "$OUT/"
done
cat "$OUT/summary.txt"
