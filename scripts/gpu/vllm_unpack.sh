# A copy of ../shared/gpu/vllm/unpack.sh (../shared does not travel to the GPU machine).
# Sourced on the GPU machine, in a command run after every part was staged into /root/vstage (README.md beside this file),
# and after the project's GPU set-up (which puts zstandard in /tmp/site): unpacks vLLM into /tmp/vsite once per
# machine and puts it first on PYTHONPATH.
if [ ! -f /tmp/vsite/.unpacked ]; then
    mkdir -p /tmp/vsite
    cat /root/vstage/p* | PYTHONPATH=/tmp/site python3 -c \
        "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" \
        | tar -x -C /tmp/vsite && touch /tmp/vsite/.unpacked
fi
# FlashInfer is not carried (its kernels alone exceed the budget): vLLM samples with its PyTorch sampler instead.
export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "import vllm; print('vllm', vllm.__version__)"
