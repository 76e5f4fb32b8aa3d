#!/bin/bash
# Add generators to a running async-rl run (started by async-rl.sbatch, or any run whose RUN_DIR holds
# servers.env and run.env): one more Slurm job, NODES nodes with GENERATORS_PER_NODE generators each.
#   scripts/slurm/add-generators.sh RUN_DIR [NODES=1] [GENERATORS_PER_NODE=1] [sbatch options...]
# EXTRA_GENERATOR_ARGS (environment) is appended to the run's generator arguments. Prints the job id.
set -euo pipefail
run_dir=$(realpath "${1:?usage: add-generators.sh RUN_DIR [NODES] [GENERATORS_PER_NODE] [sbatch options...]}")
nodes=${2:-1}
per_node=${3:-1}
shift $(( $# < 3 ? $# : 3 ))
for f in servers.env run.env; do
    [[ -f "$run_dir/$f" ]] || { echo "add-generators.sh: no $run_dir/$f: is the run's job running?" >&2; exit 1; }
done
here=$(dirname "$(realpath "$0")")
RUN_DIR="$run_dir" GENERATORS_PER_NODE="$per_node" \
    exec sbatch --parsable --nodes="$nodes" --ntasks-per-node="$per_node" --export=ALL "$@" "$here/generators.sbatch"
