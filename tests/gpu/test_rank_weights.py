"""Two Megatron ranks (expert parallel) publish their own pieces into their own GPU slots: a same-host reader in
another process and a host-transport reader (fed from every rank's slot on rank 0's GPU, encoded there, deltas
included) both get the gathered export bit for bit, version after version (``scripts/megatron/check_gpu_export.py``
under ``torchrun``; ``scripts/gpu/ranks.sh`` runs it for PP=2 and TP=2 too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_versions_reach_ipc_and_host_readers_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "ep2.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "scripts/megatron/check_gpu_export.py", "--ep", "2", "--lr", "1e-5", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and len(res["versions"]) == 4 and len(res["ranks_buckets"]) == 2
    kinds = [v["host_kind"] for v in res["versions"]]
    assert kinds[0] == "full" and "delta" in kinds, kinds  # lr 1e-5 moves few bf16 weights: deltas pay
