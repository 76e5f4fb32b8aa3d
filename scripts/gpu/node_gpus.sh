# Sourced by the one-node scripts (node.sh, node_async.sh): sets $gen_devices (NODE_GEN_DEVICES, default
# cuda:2,cuda:3: a vLLM generator on each), $generators (their count), $gpu, the machine in their JSON names (e.g.
# h100x4), $node, the recipe both run (bench loop's options; node.sh says what each is for), and whole_tracebacks;
# exits 2 naming the script where fewer GPUs are visible than the learner's two and the generators' need.
# A rehearsal on two GPUs: NODE_GEN_DEVICES=cuda:1 NODE_MODEL=moe-1.6b NODE_GEN_MEM=0.3 NODE_KV_MIB=8192 (the
# generator beside rank 1; a fixed KV cache, as vLLM's profiling would count the learner's memory growing as its own).
source "$(dirname "${BASH_SOURCE[0]}")/leftovers.sh"  # what an earlier call left on the GPUs
gen_devices=${NODE_GEN_DEVICES:-cuda:2,cuda:3}
generators=$(tr ',' '\n' <<< "$gen_devices" | grep -c .)
need=$(tr ',' '\n' <<< "$gen_devices" | sed -n 's/^cuda:\([0-9]*\)$/\1/p' | sort -n | tail -1)
need=$(( ${need:-1} + 1 > 2 ? ${need:-1} + 1 : 2 ))
read -r n gpu < <(python3 -c "import torch; n=torch.cuda.device_count(); print(n, (torch.cuda.get_device_name(0).split()[1].lower() if n else 'none') + 'x' + str(n))")
if [ "$n" -lt "$need" ]; then echo "$(basename "$0"): needs $need GPUs for generators on $gen_devices, $n visible" >&2; exit 2; fi
node=(--device cuda --backend megatron --learner-nproc 2 --learner megatron.expert_parallel=2
      --learner megatron.distributed_optimizer=${NODE_DIST_OPT:-true} --learner checkpoint.every=${NODE_CHECKPOINT_EVERY:-100}
      --generators "$generators" --generator-engine vllm --generator-devices "$gen_devices"
      --generator vllm.gpu_memory_utilization=${NODE_GEN_MEM:-0.5} --generator vllm.kv_cache_mib=${NODE_KV_MIB:-0})
whole_tracebacks() {  # every traceback in the logs given, whole (bench loop's summary keeps only their first lines)
    local f
    for f in "$@"; do
        grep -q "^Traceback" "$f" && { echo "== traceback in $f"; grep -B3 -A25 "^Traceback" "$f" | head -150; }
    done
}
