#!/usr/bin/env bash
# autoshard on GPUs, in a few minutes. Run from the repository root:
#   bash benchmarks/gpu_check.sh            (PYTHON=... to pick the interpreter)
#
# One GPU:   the demo model sharded on a 1-rank mesh in bf16, eager and torch.compile (inductor),
#            each against its fp32 single-device reference; the local GEMM of a transposed
#            [in, out] weight against F.linear on Llama-3-8B shapes in bf16 (ratio printed).
# 2+ GPUs:   the demo on all GPUs under torchrun with NCCL (dp x tp, fp32 and bf16). The 2x2
#            benchmark (bench_2d.py) runs on CPU ranks with gloo only; it is not part of this check.
# No GPU:    the same checks on CPU where they can run (the bf16 demo on a 1-rank gloo mesh,
#            the GEMM check on shapes / 8), saying what it skipped.
# Prints one summary line; exits non-zero on the first parity break or error.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
ran=()
skipped=()

step() {  # step <label> <command...>: run it, stop the script loudly if it fails
    local label=$1
    shift
    echo "== $label"
    if ! "$@"; then
        echo "gpu_check: FAILED at '$label'" >&2
        exit 1
    fi
    ran+=("$label")
}

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 1 ]; then
    step "1 GPU bf16 eager" "$PY" examples/train_llama.py --device cuda --dp 1 --tp 1 --bf16 --steps 20
    step "1 GPU bf16 inductor" "$PY" examples/train_llama.py --device cuda --dp 1 --tp 1 --bf16 --compile inductor --steps 20
    step "GEMM x @ W_t vs F.linear (Llama-8B, bf16)" "$PY" benchmarks/gemm_transposed.py --device cuda
else
    skipped+=("1-GPU demo and GEMM on CUDA (no CUDA device)")
    step "1 rank bf16 eager (CPU)" "$PY" examples/train_llama.py --device cpu --dp 1 --tp 1 --bf16 --steps 5
    step "GEMM x @ W_t vs F.linear (CPU, shapes / 8)" "$PY" benchmarks/gemm_transposed.py --device cpu --repeats 3
fi
if [ "$gpus" -ge 2 ]; then
    tp=2
    dp=$((gpus / tp))
    torchrun_py=("$PY" -m torch.distributed.run --standalone --nproc-per-node $((dp * tp)))
    step "$((dp * tp)) GPUs fp32 (dp=$dp x tp=$tp, NCCL)" "${torchrun_py[@]}" examples/train_llama.py --device cuda --dp $dp --tp $tp
    step "$((dp * tp)) GPUs bf16 (dp=$dp x tp=$tp, NCCL)" "${torchrun_py[@]}" examples/train_llama.py --device cuda --dp $dp --tp $tp --bf16
else
    skipped+=("multi-GPU NCCL runs (fewer than 2 GPUs)")
fi
summary="gpu_check: passed ${#ran[@]} check(s) on $gpus GPU(s)"
if [ ${#skipped[@]} -gt 0 ]; then
    summary+="; skipped: $(IFS=';'; echo "${skipped[*]}")"
fi
echo "$summary"
