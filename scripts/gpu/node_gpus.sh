# Sourced by the one-node scripts (node.sh, node_async.sh): sets $gpu, the machine in their JSON names (e.g. h100x4),
# and exits 2 naming the script where fewer than four GPUs are visible.
read -r n gpu < <(python3 -c "import torch; n=torch.cuda.device_count(); print(n, (torch.cuda.get_device_name(0).split()[1].lower() if n else 'none') + 'x' + str(n))")
if [ "$n" -lt 4 ]; then echo "$(basename "$0"): needs 4 GPUs, $n visible" >&2; exit 2; fi
