"""The fused logit statistics (async_rl/logprobs/stats.py): the torch definition against log_softmax, bad input, and the
Triton kernels against the definition in Triton's interpreter on the CPU (``fused_logit_stats_cases.py`` in a child
pytest: the interpreter must be chosen before torch imports Triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_rl.logprobs.stats import reference_token_stats, token_stats


def test_fused_kernels_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    cases = Path(__file__).with_name("fused_logit_stats_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", str(cases)],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-500:]


def test_reference_is_what_the_backends_computed() -> None:
    """The definition equals the plain torch steps the backends ran before (cast, mask, temperature, logsumexp)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 30, generator=g, dtype=torch.float64)
    y = torch.randint(0, 30, (4,), generator=g)
    lp, ent = reference_token_stats(x, y, temperature=1.3, with_entropy=True)
    logp = torch.log_softmax(x / 1.3, -1)
    torch.testing.assert_close(lp, logp.gather(-1, y[:, None]).squeeze(-1))
    assert ent is not None
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="targets of the leading shape"):
        token_stats(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_stats(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
