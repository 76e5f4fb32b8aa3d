#!/usr/bin/env bash
# Learner backends on one GPU at real MoE shapes (issue 28), reproducible: the chunked-logprobs GPU test (values,
# gradients and peak memory at the 151,936 vocabulary), then `bench backends` on the Qwen3-30B-A3B slice (Megatron
# with SDPA + grouped experts; torch with full logits and with logprob chunks of 4096), then on the 1.65B shape of
# `bench loop` (16 layers, hidden 1024, 64 experts top-8, every layer MoE as the moe-1.6b preset); with two GPUs, the
# slice under EP=2 against one GPU on the same 16k-token micro-batches. With four GPUs (issue 39), instead: EP=4 against
# one GPU at the same load a GPU: one GPU trains SCALE_SEQUENCES (default 16, the preset's step) in micro-batches of
# SCALE_RANK_MB_TOKENS (default 8192), EP=4 trains four times the sequences in micro-batches of four times the tokens,
# which the backend splits into a micro-batch of up to SCALE_RANK_MB_TOKENS for each of its four data-parallel ranks
# (balance.py): every GPU trains micro-batches of the one GPU's size, and a step of as many tokens a GPU (how an RL
# step grows with the learner's GPUs). Then EP=4 on SCALE_LAYERS (default 8) layers, which one GPU cannot hold (MFU),
# then EP=4 on the one GPU's step itself (16 sequences over four GPUs: the fixed costs a step, shared by fewer tokens
# a GPU), and OUT_DIR/scaling-<gpu>x4-ep4-30b-a3b-slice.json with tokens_per_s_per_gpu_vs_one_gpu and each run's MFU.
# One JSON per bench in OUT_DIR; logs beside them. ONLY=scaling runs the four-GPU part alone.
#   scripts/gpu/backends.sh OUT_DIR [LAYERS]      (LAYERS of the slice, default 2; 4 is tight for Megatron)
set -euo pipefail
out=${1:?usage: backends.sh OUT_DIR [LAYERS]}
layers=${2:-2}
mkdir -p "$out"
source "$(dirname "$0")/leftovers.sh"  # what an earlier call left on the GPUs
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
rc=0
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "${ONLY:-}" != scaling ]; then
python3 -m pytest --noconftest -o addopts="" -q -s tests/gpu/test_chunked_logprobs_gpu.py tests/gpu/test_logit_stats_gpu.py 2>&1 | tail -8 \
    | tee "$out/chunked-logprobs-$gpu.log" || rc=1
python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --layers "$layers" --default-settings-only \
    --logprob-chunk-tokens 0,4096 --profile --json "$out/megatron-backends-${gpu}-30b-a3b-slice-${layers}l.json" 2>&1 \
    | grep -v Warning | tail -20 | tee "$out/backends-30b-a3b-slice.log" || rc=1
python3 -m actors.commands bench backends --default-settings-only --layers 16 --hidden 1024 --experts 64 --top-k 8 \
    --moe-ffn 512 --heads 16 --kv-heads 4 --head-dim 64 --dense-first 0 --vocab 32768 --seq 1024 --batch 8 \
    --micro-batches 2 \
    --logprob-chunk-tokens 0,4096 --profile --json "$out/megatron-backends-${gpu}-1.6b.json" 2>&1 \
    | grep -v Warning | tail -20 | tee "$out/backends-1.6b.log" || rc=1
fi
if [ "$ngpu" -ge 4 ]; then
    rank_mb=${SCALE_RANK_MB_TOKENS:-8192}
    seqs=${SCALE_SEQUENCES:-16}
    deep=${SCALE_LAYERS:-8}
    one="$out/megatron-backends-${gpu}-30b-a3b-slice-${layers}l-${rank_mb}.json"
    ep4="$out/megatron-backends-${gpu}x4-ep4-30b-a3b-slice-${layers}l-4x${rank_mb}.json"
    ep4_deep="$out/megatron-backends-${gpu}x4-ep4-30b-a3b-slice-${deep}l-4x${rank_mb}.json"
    ep4_same="$out/megatron-backends-${gpu}x4-ep4-30b-a3b-slice-${layers}l-one-gpu-step.json"
    python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --layers "$layers" --backends megatron \
        --default-settings-only --sequences "$seqs" --micro-batch-tokens "$rank_mb" --json "$one" 2>&1 \
        | grep -v Warning | tail -4 | tee "$out/scaling-one-gpu.log" || rc=1
    for run in "$layers:$((4 * seqs)):$ep4" "$deep:$((4 * seqs)):$ep4_deep" "$layers:$seqs:$ep4_same"; do
        IFS=: read -r n_layers n_seqs json <<< "$run"
        torchrun --standalone --nproc-per-node 4 -m actors.commands bench backends --preset qwen3-30b-a3b-slice \
            --layers "$n_layers" --backends megatron --expert-parallel 4 --sequences "$n_seqs" \
            --micro-batch-tokens $((4 * rank_mb)) --profile --json "$json" \
            2>&1 | grep -v Warning | tail -40 | tee -a "$out/scaling-ep4.log" || rc=1
    done
    python3 - "$one" "$ep4" "$ep4_deep" "$ep4_same" "$out/scaling-${gpu}x4-ep4-30b-a3b-slice.json" <<'PY' || rc=1
import json, sys
from pathlib import Path

def row(path):
    p = Path(path)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    r = next(r for r in data["results"] if r["backend"] == "megatron")
    prof = r.get("profile") or {}
    return {"json": p.name, "layers": data["model"].get("layers"), "world_size": r.get("world_size") or 1,
            "sequences": len([n for mb in data["batch"]["sequence_lengths"] for n in mb]),
            "tokens_per_step": data["batch"]["tokens_per_step"], "micro_batch_tokens": data["batch"]["micro_batch_tokens"],
            "step_time_s": r["step_time_s_median"], "tokens_per_s": r["tokens_per_s"],
            "tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu") or r["tokens_per_s"], "mfu": r["mfu"],
            "peak_memory_gib": r["peak_memory_gib"], "gpu_busy_frac": prof.get("gpu_busy_frac"), "device": data["device"]}

one, ep4, deep, same = (row(p) for p in sys.argv[1:5])
ratio = ep4["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"] if one and ep4 else None
out = {"bench": "scaling",
       "comparison": "the same load a GPU: the one GPU's step and micro-batches on each of the four (weak scaling)",
       "one_gpu": one, "ep4": ep4, "ep4_deep": deep, "ep4_one_gpu_step": same,
       "tokens_per_s_per_gpu_vs_one_gpu": ratio, "ep4_deep_mfu": deep["mfu"] if deep else None,
       "one_gpu_step_tokens_per_s_per_gpu_vs_one_gpu": (same["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
                                                        if one and same else None)}
Path(sys.argv[5]).write_text(json.dumps(out, indent=2))
print(json.dumps({k: v for k, v in out.items() if k != "bench"}, indent=1))
PY
elif [ "$ngpu" -ge 2 ] && [ "${ONLY:-}" != scaling ]; then
    # EP=2 on two GPUs against one GPU (tokens/s per GPU), both on micro-batches of up to 16k tokens so that each of
    # the two data-parallel ranks holds a sequence of most micro-batches.
    python3 -m actors.commands bench backends --preset qwen3-30b-a3b-slice --layers "$layers" --backends megatron \
        --default-settings-only --micro-batch-tokens 16384 \
        --json "$out/megatron-backends-${gpu}-30b-a3b-slice-${layers}l-16k.json" 2>&1 \
        | grep -v Warning | tail -4 | tee "$out/backends-30b-a3b-slice-16k.log" || rc=1
    torchrun --standalone --nproc-per-node 2 -m actors.commands bench backends --preset qwen3-30b-a3b-slice \
        --layers "$layers" --backends megatron --expert-parallel 2 --micro-batch-tokens 16384 \
        --json "$out/megatron-backends-${gpu}x2-ep2-30b-a3b-slice-${layers}l-16k.json" 2>&1 \
        | grep -v Warning | tail -4 | tee "$out/backends-30b-a3b-slice-ep2.log" || rc=1
fi
exit $rc
