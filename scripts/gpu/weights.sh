#!/usr/bin/env bash
# The weight path on GPUs, reproducible: the GPU weight tests (CUDA IPC between processes, a reader SIGKILLed
# mid-copy, another namespace refused), then `bench loop` on the 1.65B MoE (moe-1.6b, 3.3 GB in bf16) with the
# torch learner on GPU 0 and one generator on each GPU, with the GPU path (publisher.gpu=auto) and without it
# (publisher.gpu=off: the host transport only), one summary JSON each in OUT_DIR. hostenc: the generators take the host
# transport (weight_sync.gpu=false) from a learner with the GPU path on, at an RL learning rate (1e-5), its versions
# encoded on the GPU (publisher.gpu_encode, the default) and then on the CPU (the path before), side by side.
#   scripts/gpu/weights.sh OUT_DIR [STEPS] [which: tests,gpu,host,megatron,hostenc]
set -uo pipefail
out=${1:?usage: weights.sh OUT_DIR [STEPS] [WHICH]}
steps=${2:-30}
which=${3:-tests,gpu,host}
mkdir -p "$out"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
devices=cuda:0; [ "$ngpu" -ge 2 ] && devices=cuda:0,cuda:1
rc=0
if [[ ,$which, == *,tests,* ]]; then
    python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_gpu_weights.py > "$out/gpu-tests.txt" 2>&1 || rc=1
    tail -5 "$out/gpu-tests.txt"
fi
loop() {  # NAME BACKEND EXTRA...
    local name=$1 backend=$2; shift 2
    local dir=/tmp/runs/$name-$(date +%s)
    python3 -m actors.commands bench loop --model moe-1.6b --device cuda --backend "$backend" --steps "$steps" \
        --max-minutes 4 --generators 2 --generator-devices "$devices" --generator torch.model.dtype=bfloat16 \
        --json "$out/loop-${gpu_name}x${ngpu}-1.6b-$name.json" --run-dir "$dir" "$@" > "$out/$name.txt" 2>&1 || rc=1
    for f in "$dir"/*.log; do echo "== $f"; grep -v " DEBUG " "$f" | tail -15; done >> "$out/$name.txt"
    python3 - "$out/loop-${gpu_name}x${ngpu}-1.6b-$name.json" <<'PY' || true
import json, sys
s = json.load(open(sys.argv[1]))
print(sys.argv[1], {k: s.get(k) for k in ("outcome", "steps", "steps_per_s", "train_s", "step_interval_s",
      "publish_block_frac", "version_to_applied_s", "gpu_publish_latency_s", "publish_latency_s",
      "delta_bytes_ratio", "host_encode_s", "swap_wait_s",
      "learner_idle_frac", "generator_idle_frac", "generator_fetch_s", "tracebacks")})
PY
}
[[ ,$which, == *,gpu,* ]] && loop torch-gpu torch
[[ ,$which, == *,host,* ]] && loop torch-host torch --learner publisher.gpu=off --generator weight_sync.gpu=false
[[ ,$which, == *,megatron,* ]] && loop megatron-gpu megatron
if [[ ,$which, == *,hostenc,* ]]; then
    loop torch-host-gpuenc torch --lr 1e-5 --generator weight_sync.gpu=false
    loop torch-host-cpuenc torch --lr 1e-5 --generator weight_sync.gpu=false --learner publisher.gpu_encode=false
fi
exit $rc
