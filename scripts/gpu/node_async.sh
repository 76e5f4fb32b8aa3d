#!/usr/bin/env bash
# Asynchronous against synchronous RL on one node of four GPUs (issue 39): `bench async` with the node recipe of
# node.sh (a Megatron learner on GPUs 0-1, EP=2 with the distributed optimizer; a vLLM generator on each of GPUs 2 and
# 3), on the quickstart's task and model, to exact-match NODE_ASYNC_TARGET (default 0.9).
#   source scripts/gpu/setup.sh && source scripts/gpu/vllm_unpack.sh && scripts/gpu/node_async.sh OUT
# One device call holds ten minutes, the whole bench more: each call runs the plans of NODE_ASYNC_STALENESS (default
# 4; the synchronous run always) that /root/node-async.json does not hold yet (`bench async --reuse`: kept while the
# machine stays warm), NODE_ASYNC_MINUTES (default 6: on four H200s Megatron and vLLM started in 96-101 s, then the
# synchronous run trained 167 s) each at most; a run the call's time limit stops is not kept: the next call runs it.
# Call it again with NODE_ASYNC_STALENESS=2,4,8 for the rest. NODE_GEN_DEVICES moves the generators (node_gpus.sh: a
# two-GPU rehearsal); NODE_ASYNC_MODEL another model (e.g. moe-107m, which learns the task too). Writes
# OUT/async-<gpu>x4-megatron-vllm-<date>.json (best_async_vs_sync, each run's wall time to the target and idle
# fractions, its full bench loop summary; written after each run, so a call the device cuts short keeps the runs it
# finished), the plot beside it (.png) and OUT/node-async.log.
set -uo pipefail
out=${1:?usage: node_async.sh OUT}
mkdir -p "$out"
source "$(dirname "$0")/node_gpus.sh"
keep=/root/node-async.json
reuse=()
if [ -f "$keep" ]; then reuse=(--reuse "$keep"); fi
json="$out/async-$gpu-megatron-vllm-$(date +%Y-%m-%d).json"
runs=/tmp/bench-async-node-$(date +%s)  # a fresh one each call: bench loop refuses a directory holding a cut run
timeout ${NODE_ASYNC_TIMEOUT:-540} python3 -m actors.commands bench async --json "$json" --plot "${json%.json}.png" \
    "${node[@]}" --target ${NODE_ASYNC_TARGET:-0.9} --staleness ${NODE_ASYNC_STALENESS:-4} \
    --max-minutes ${NODE_ASYNC_MINUTES:-6} --run-dir "$runs" \
    ${NODE_ASYNC_MODEL:+--model "$NODE_ASYNC_MODEL"} "${reuse[@]}" > "$out/node-async.log" 2>&1
rc=$?
whole_tracebacks "$runs"/*/*.log >> "$out/node-async.log"  # after the bench's output: what a fix needs
tail -30 "$out/node-async.log"
if [ -f "$json" ]; then cp "$json" "$keep"; fi
exit $rc
