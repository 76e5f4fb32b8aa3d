#!/usr/bin/env bash
# Every learner rank publishes its own pieces (two GPUs).
#   checks: what a same-host reader assembles over CUDA IPC, and what a host-transport reader applies (fed from every
#           rank's slot on rank 0's GPU, encoded there; ep2-cpuenc: on the CPU), against the gathered export, bit for
#           bit (EP=2 at lr 1e-5 so that deltas go out, PP=2, TP=2; scripts/megatron/check_gpu_export.py);
#   loops:  `bench loop` with the 2-rank Megatron learner (moe-107m, EP=2 and PP=2) on the GPU path, generators on the
#           last GPU, the host transport fed too (publisher.gpu_host_copies, the default); ep-host: the generators
#           forced onto the host transport (weight_sync.gpu=false) at lr 1e-5.
#   scripts/gpu/ranks.sh OUT_DIR [STEPS] [which: checks,loops]
set -uo pipefail
out=${1:?usage: ranks.sh OUT_DIR [STEPS] [WHICH]}
steps=${2:-30}
which=${3:-checks,loops}
mkdir -p "$out"
gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
rc=0
check() {  # TAG ARGS...
    local tag=$1; shift
    timeout 150 torchrun --standalone --nproc-per-node 2 scripts/megatron/check_gpu_export.py "$@" \
        --out "$out/gpu-export-$tag.json" > "$out/gpu-export-$tag.log" 2>&1 || { rc=1; tail -20 "$out/gpu-export-$tag.log"; }
    tail -1 "$out/gpu-export-$tag.log" | cut -c1-600
}
if [[ ,$which, == *,checks,* ]]; then
    check ep2 --ep 2 --lr 1e-5
    check ep2-cpuenc --ep 2 --lr 1e-5 --cpu-encode
    check pp2 --pp 2
    check tp2 --tp 2
fi
loop() {  # TAG LAYOUT EXTRA...
    local tag=$1 layout=$2; shift 2
    local dir=/tmp/runs/ranks-$tag-$(date +%s) json=$out/loop-${gpu_name}x2-megatron-$tag-gpu.json
    timeout 200 python3 -m actors.commands bench loop --model moe-107m --device cuda --backend megatron --steps "$steps" \
        --max-minutes 3 --learner-nproc 2 --learner "$layout" \
        --generator torch.device=cuda:1 --generator torch.model.dtype=bfloat16 \
        --json "$json" --run-dir "$dir" "$@" > "$out/loop-$tag.log" 2>&1 || rc=1
    for f in "$dir"/*.log; do echo "== $f"; grep -v " DEBUG " "$f" | tail -12; done >> "$out/loop-$tag.log"
    python3 -c "
import json, sys
s = json.load(open('$json'))
print('$tag', {k: s.get(k) for k in ('outcome', 'steps', 'steps_per_s', 'train_s', 'step_interval_s', 'publish_block_frac',
      'version_to_applied_s', 'gpu_publish_latency_s', 'publish_latency_s', 'host_encode_s', 'delta_bytes_ratio',
      'learner_idle_frac', 'generator_idle_frac', 'tracebacks')})" || true
}
if [[ ,$which, == *,loops,* ]]; then
    loop ep megatron.expert_parallel=2
    loop pp megatron.pipeline_parallel=2
    loop ep-host megatron.expert_parallel=2 --lr 1e-5 --generator weight_sync.gpu=false
fi
exit $rc
