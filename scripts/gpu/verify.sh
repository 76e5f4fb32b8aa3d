#!/usr/bin/env bash
# What landed without running on a GPU, checked in one device call (two GPUs: nvidia-h100-x2), each part's output
# in OUT_DIR: the GPU test files (the weight path over CUDA IPC, chunked logprobs at a 151k vocabulary, the Megatron
# export against a real checkpoint, the Megatron backend's parity with torch after its weights were split into
# actors/learner/megatron/weights.py), then the per-rank GPU versions against the gathered export (scripts/gpu/ranks.sh
# without its loops). Wheels: ../shared/gpu/fetch-wheels.sh and scripts/gpu/fetch-extra-wheels.sh, carry [".whl"].
#   source scripts/gpu/setup.sh && scripts/gpu/verify.sh OUT_DIR
set -uo pipefail
out=${1:?usage: verify.sh OUT_DIR}
mkdir -p "$out"
rc=0
for t in tests/gpu/test_gpu_weights.py tests/gpu/test_chunked_logprobs_gpu.py tests/gpu/test_logit_stats_gpu.py \
         tests/gpu/test_megatron_export.py \
         tests/gpu/test_megatron_backend.py tests/gpu/test_torch_backend_gpu.py; do
    name=$(basename "$t" .py)
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider "$t" > "$out/$name.txt" 2>&1 || rc=1
    echo "$name: $(tail -1 "$out/$name.txt")"
done
for layout in "ep 2" "pp 2"; do
    set -- $layout
    timeout 150 torchrun --standalone --nproc-per-node 2 scripts/megatron/check_gpu_export.py --$1 $2 \
        --out "$out/gpu-export-$1$2.json" > "$out/gpu-export-$1$2.log" 2>&1 || rc=1
    echo "gpu-export $1=$2: $(tail -1 "$out/gpu-export-$1$2.log" | cut -c1-200)"
done
exit $rc
