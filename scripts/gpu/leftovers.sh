# Sourced at the start of a GPU script: names the processes on the GPUs before it measures anything, and with
# ARL_GPU_LEFTOVERS=kill stops those of this project (a command line with `actors.commands`, or vLLM's engine
# processes: `VLLM::...`). A device call cut by its time limit can leave such processes behind (a learner rank blocked
# in a collective spins on its GPU; a vLLM engine holds its memory) and they would share the GPUs with what the next
# call measures: scripts/gpu/setup.sh, sourced by every device command, sets ARL_GPU_LEFTOVERS=kill. Elsewhere the
# default only warns: on a machine of your own they may be another run of yours.
leftover_pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sort -u | tr '\n' ' ')
if [ -n "${leftover_pids// /}" ]; then
    echo "leftovers: processes on the GPUs before this script starts:" >&2
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >&2
    ours=""
    for pid in $leftover_pids; do
        cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)
        case "$cmd" in *actors.commands*|VLLM::*) ours="$ours $pid" ;; esac
    done
    if [ "${ARL_GPU_LEFTOVERS:-warn}" = kill ] && [ -n "$ours" ]; then
        echo "leftovers: stopping this project's:$ours" >&2
        kill $ours 2>/dev/null
        for _ in $(seq 20); do kill -0 $ours 2>/dev/null || break; sleep 0.5; done
        kill -9 $ours 2>/dev/null
        sleep 1
    else
        echo "leftovers: left running (ARL_GPU_LEFTOVERS=kill stops this project's:${ours:- none});" \
             "what follows shares the GPUs with them" >&2
    fi
    unset ours cmd pid
fi
unset leftover_pids
