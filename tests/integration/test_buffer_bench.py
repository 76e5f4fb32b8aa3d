"""`async-rl bench buffer` end to end on a small payload: every reported key is there and sane."""

from __future__ import annotations

import json

from actors.commands.bench.buffer import decode_b64json, decode_json, encode_b64json, encode_json, make_group
from actors.commands.cli import main as cli_main

KEYS = ("group_bytes", "ours_gbps", "raw_gbps", "json_gbps", "b64json_gbps", "ratio_vs_raw", "speedup_vs_json",
        "speedup_vs_b64json", "groups_per_s")  # fmt: skip


def test_baseline_codecs_round_trip():
    rec = make_group(group_id="g", prompt_tokens=4, response_tokens=5, num_samples=2, moe_layers=2, top_k=2)
    expect = [rec.prompt_ids]
    for s in rec.samples:
        expect += [s.response_ids, s.logprobs, s.versions, s.routes]
    for got in (decode_json(encode_json(rec)), decode_b64json(encode_b64json(rec))):
        assert len(got) == len(expect)
        for a, b in zip(got, expect, strict=True):
            assert a.dtype == b.dtype and (a == b).all()


def test_bench_buffer_cli_writes_json(servers, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "buffer", "--json", str(out), "--redis-url", servers.redis_url, "--groups", "3",
            "--json-groups", "1", "--repeats", "1", "--response-tokens", "64", "--moe-layers", "4"]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads(out.read_text())
    for key in KEYS:
        assert result[key] > 0, key
    assert result["group_bytes"] == 4 * 256 + 8 * (64 * 12 + (256 + 63) * 4 * 8)
    assert result["machine"]["cpu_cores"] >= 1 and result["machine"]["server"]
    assert json.loads(capsys.readouterr().out)["group_bytes"] == result["group_bytes"]
