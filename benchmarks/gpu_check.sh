#!/usr/bin/env bash
# autoshard on GPUs: every feature a GPU changes, each against one device, one line per check.
# Run from the repository root:
#   bash benchmarks/gpu_check.sh            (PYTHON=... to pick the interpreter)
#
# One GPU:   the demo model sharded on a 1-rank mesh in bf16, eager and torch.compile (inductor),
#            each against its fp32 single-device reference; the local GEMM of a transposed
#            [in, out] weight against F.linear on Llama-3-8B shapes in bf16 (worst time ratio).
# 2+ GPUs:   benchmarks/gpu_check.py under torchrun, NCCL, one rank per GPU (an even count): every
#            tp collective; bf16 tp sums as an all-to-all + all-gather (tp=4); training in fp32
#            (dp x tp) and bf16 (tp=4); the fp8 block-quantized FSDP all-gather; the compile backend
#            with inductor; a checkpoint saved on dp x tp and loaded on tp only; sequence + loss
#            parallel; torch's default device other than the mesh's.
# No GPU:    the GEMM check on shapes / 8, and gpu_check.py under torchrun on 4 CPU gloo ranks (its
#            compile check with dynamo's eager backend); the one-GPU demos print SKIP.
# Prints one line per check (name, PASS / FAIL / SKIP, what it measured against one device), then
# a summary line; exits 1 if any check failed. Each command's output is kept in a log directory,
# named on failure.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
passed=0
failed=0
skipped=0

report() {  # report <name> <status> <detail>: one line, counted by status
    printf '%-44s %-4s  %s\n' "$1" "$2" "$3"
    case $2 in
        PASS) passed=$((passed + 1)) ;;
        FAIL) failed=$((failed + 1)) ;;
        SKIP) skipped=$((skipped + 1)) ;;
    esac
}

single() {  # single <name> <regex of the measured number> <command...>: one line for one command
    local name=$1 measure=$2
    shift 2
    local log
    log="$logs/$(tr -c 'A-Za-z0-9\n' '_' <<<"$name").log"
    local status=PASS
    "$@" >"$log" 2>&1 || status=FAIL
    local measured
    measured=$(grep -oE "$measure" "$log" | tail -n 1 || true)
    if [ "$status" = FAIL ]; then
        measured="${measured:+$measured; }see $log"
    fi
    report "$name" "$status" "${measured:-nothing measured; see $log}"
}

ranks() {  # ranks <command...>: gpu_check.py's lines (one per check), counted; a crash is a FAIL line
    local log="$logs/ranks.log" lines="$logs/ranks.lines"
    local code=0
    "$@" >"$lines" 2>"$log" || code=$?
    local line
    while IFS= read -r line; do
        if [[ $line =~ ^(.{44})\ (PASS|FAIL|SKIP)\ \ (.*)$ ]]; then
            report "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}"
        else
            printf '%s\n' "$line" >>"$log"  # not a check's line: a library's print
        fi
    done <"$lines"
    if [ "$code" -ne 0 ] && ! grep -qE '^.{44} FAIL  ' "$lines"; then
        report "multi-rank checks" FAIL "exit code $code; see $log"
    fi
}

loss_parity='max \|loss - reference\| = [^ ]+ \(relative [^,]+, tolerance [^)]+\)'
gemm_ratio='gemm ratio worst [0-9.]+ \([^)]*\)'
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 1 ]; then
    single "1 GPU bf16 eager (demo, 20 steps)" "$loss_parity" \
        "$PY" examples/train_llama.py --device cuda --dp 1 --tp 1 --bf16 --steps 20
    single "1 GPU bf16 inductor (demo, 20 steps)" "$loss_parity" \
        "$PY" examples/train_llama.py --device cuda --dp 1 --tp 1 --bf16 --compile inductor --steps 20
    single "GEMM x @ W_t vs F.linear (Llama-8B, bf16)" "$gemm_ratio" \
        "$PY" benchmarks/gemm_transposed.py --device cuda
else
    report "1 GPU bf16 eager (demo, 20 steps)" SKIP "no CUDA device"
    report "1 GPU bf16 inductor (demo, 20 steps)" SKIP "no CUDA device"
    single "GEMM x @ W_t vs F.linear (CPU, shapes / 8)" "$gemm_ratio" \
        "$PY" benchmarks/gemm_transposed.py --device cpu --repeats 3
fi
torchrun=("$PY" -m torch.distributed.run --standalone)
if [ "$gpus" -ge 2 ]; then
    ranks "${torchrun[@]}" --nproc-per-node $((gpus - gpus % 2)) benchmarks/gpu_check.py --device cuda
elif [ "$gpus" -eq 1 ]; then
    ranks "$PY" benchmarks/gpu_check.py --skip "needs 2 or more GPUs"
else
    ranks "${torchrun[@]}" --nproc-per-node 4 benchmarks/gpu_check.py --device cpu
fi
summary="gpu_check: $passed passed, $failed failed, $skipped skipped on $gpus GPU(s)"
if [ "$failed" -gt 0 ]; then
    echo "$summary; logs in $logs"
    exit 1
fi
rm -rf "$logs"
echo "$summary"
