# Sourced at the start of a GPU script: stops what an earlier device call left running on the GPUs. A call cut by
# its time limit can leave processes behind (a learner rank blocked in a collective spins on its GPU; a vLLM engine
# holds its memory), and they would share the GPUs with what this call measures. The lent machine runs nothing
# else, so every compute process found is a leftover: each is named, then killed (SIGTERM, SIGKILL after 10 s).
leftover_pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sort -u | tr '\n' ' ')
if [ -n "${leftover_pids// /}" ]; then
    echo "leftovers: stopping GPU processes of an earlier call:" >&2
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >&2
    kill $leftover_pids 2>/dev/null
    for _ in $(seq 20); do kill -0 $leftover_pids 2>/dev/null || break; sleep 0.5; done
    kill -9 $leftover_pids 2>/dev/null
    sleep 1
fi
unset leftover_pids
