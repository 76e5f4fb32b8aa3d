#!/usr/bin/env bash
# Check Megatron parallel layouts against a single-GPU reference on one host (run from the repo root).
#   scripts/megatron/run_layouts.sh OUTDIR x2   # 2 GPUs: PP=2 uneven (3+4, dense layer 0), PP=2 (4+3), EP=2 (also
#                                               # with the distributed optimizer), TP=2+SP
#   scripts/megatron/run_layouts.sh OUTDIR x4   # 4 GPUs (issues 8, 39): EP=4, PP=2 x EP=2, TP=2 x EP=2 (+SP),
#                                               # DP=2 x EP=2 (EP=2 on 4 ranks: every expert on two ranks, dense DP=4;
#                                               # also with the distributed optimizer),
#                                               # and PP=2 x CP=2 where Transformer Engine is installed
# Without x2|x4: x4 when 4 or more GPUs are visible, else x2. On x4 every layout is also published rank by rank
# (scripts/megatron/check_gpu_export.py on 4 ranks: a CUDA IPC reader and a host-transport reader get the gathered
# export bit for bit, before and after optimizer steps): entries NAME-export, passed when every version matched.
# Writes OUTDIR/layouts.json (one entry per layout and check, with pass/fail) and OUTDIR/layouts.log (all output).
set -uo pipefail
out=${1:?usage: run_layouts.sh OUTDIR [x2|x4]}
kind=${2:-$(python3 -c "import torch; print('x4' if torch.cuda.device_count() >= 4 else 'x2')")}
mkdir -p "$out"
ref=/tmp/megatron_layout_ref.pt
work=$(mktemp -d)
# Never use NVLink multicast on shared hosts.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)"

run() {
  local name=$1 n=$2; shift 2
  # ONLY="a b": run just these layouts (the reference always runs).
  if [ -n "${ONLY:-}" ] && [ "$name" != ref ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "=== $name (nproc $n): $*" | tee -a "$out/layouts.log"
  timeout 300 torchrun --standalone --nproc-per-node "$n" scripts/megatron/check_layout.py --name "$name" \
    --out "$work/$name.json" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warnings.warn\|tp_group\|DEPRECATED\|^\s*$" "$work/$name.log" | tail -60 >>"$out/layouts.log"
  echo "=== $name rc=$rc" | tee -a "$out/layouts.log"
}

export_check() {  # NAME NPROC ARGS...: per-rank publishing of this layout, bit for bit (the NAME-export entry)
  local name=$1-export n=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${name%-export} "* ]]; then return; fi
  echo "=== $name (nproc $n): $*" | tee -a "$out/layouts.log"
  timeout 200 torchrun --standalone --nproc-per-node "$n" scripts/megatron/check_gpu_export.py "$@" \
    --out "$work/$name.json" >"$work/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warnings.warn\|tp_group\|DEPRECATED\|^\s*$" "$work/$name.log" | tail -20 | cut -c1-600 >>"$out/layouts.log"
  echo "=== $name rc=$rc" | tee -a "$out/layouts.log"
}

run ref 1 --save-ref "$ref"
if [ "$kind" = x2 ]; then
  run pp2_first3 2 --pp 2 --first-stage-layers 3 --ref "$ref"
  run pp2_last3 2 --pp 2 --last-stage-layers 3 --ref "$ref"
  run ep2 2 --ep 2 --ref "$ref"
  run ep2_distopt 2 --ep 2 --dist-opt --ref "$ref"
  run pp2_first3_follow 2 --pp 2 --first-stage-layers 3 --follow --ref "$ref"
  run tp2_sp 2 --tp 2 --sp --ref "$ref"
else
  run ep4 4 --ep 4 --ref "$ref"
  run pp2_ep2 4 --pp 2 --ep 2 --first-stage-layers 3 --ref "$ref"
  run tp2_ep2_sp 4 --tp 2 --ep 2 --sp --ref "$ref"
  run dp2_ep2 4 --ep 2 --ref "$ref"
  run dp2_ep2_distopt 4 --ep 2 --dist-opt --ref "$ref"
  # lr 1e-5 as in scripts/gpu/ranks.sh: few bf16 weights move a step, so the host transport sends deltas too
  export_check ep4 4 --ep 4 --lr 1e-5
  export_check pp2_ep2 4 --pp 2 --ep 2
  export_check tp2_ep2_sp 4 --tp 2 --ep 2
  export_check dp2_ep2 4 --ep 2 --lr 1e-5
  export_check dp2_ep2_distopt 4 --ep 2 --lr 1e-5 --dist-opt
  if python3 -c "import transformer_engine" 2>/dev/null; then
    run pp2_cp2 4 --pp 2 --cp 2 --first-stage-layers 3 --ref "$ref"
  else
    echo "=== pp2_cp2 skipped: context parallelism needs Transformer Engine, not installed" | tee -a "$out/layouts.log"
  fi
fi
python3 - "$work" "$out/layouts.json" <<'PY'
import json, pathlib, sys
work, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
res = {}
for p in sorted(work.glob("*.json")):
    res[p.stem] = json.loads(p.read_text())
for p in sorted(work.glob("*.log")):
    if p.stem not in res:
        res[p.stem] = {"name": p.stem, "passed": False, "error_tail": p.read_text()[-3000:]}
for v in res.values():  # check_gpu_export.py says "ok"
    v.setdefault("passed", v.get("ok", False))
dst.write_text(json.dumps(res, indent=2))
print({k: v.get("passed") for k, v in res.items()})
sys.exit(0 if all(v["passed"] for v in res.values()) else 1)
PY
