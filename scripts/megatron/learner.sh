#!/usr/bin/env bash
# Start the Megatron learner under torchrun on one host: rank 0 reads the rollout stream and publishes
# weights, the other ranks follow it (MegatronBackend.follow()). Runs from a checkout on PYTHONPATH too
# (no console script needed): torchrun starts `python -m actors.commands learner`.
#   scripts/megatron/learner.sh NPROC --config run.toml backend=megatron \
#       megatron.pipeline_parallel=2 megatron.expert_parallel=2 ...
# Several hosts: run torchrun yourself with --nnodes/--node-rank/--rdzv-endpoint and the same arguments.
set -euo pipefail
nproc=${1:?usage: learner.sh NPROC [async-rl learner arguments...]}
shift
exec torchrun --standalone --nproc-per-node "$nproc" -m actors.commands learner "$@"
