"""The engine core's outputs travel as one frame each (actors/generator/vllm_compat.py: whole messages).

vLLM's own encoder, in the environment the engine starts its processes with: the arrays of an output (a finished
response's routed experts, its logprobs) stay inside the message, so the frame zmq tracks is the buffer vLLM reuses.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from actors.generator.vllm_compat import INLINE_ALL_ARRAYS, prepare_engine_processes

pytestmark = pytest.mark.vllm

THRESHOLD = "VLLM_MSGPACK_ZERO_COPY_THRESHOLD"


def outputs() -> dict[str, object]:
    """What one engine step carries for a few finished responses of 128 tokens on moe-5b (24 layers, top-8)."""
    rng = np.random.default_rng(0)
    return {f"req-{i}": {"routed_experts": rng.integers(0, 64, (140, 24, 8), dtype=np.uint8),
                         "logprobs": rng.standard_normal(128).astype(np.float32)} for i in range(4)}  # fmt: skip


def encode(msg: dict[str, object]) -> list[bytes]:
    from vllm.v1.serial_utils import MsgpackEncoder

    return [bytes(b) for b in MsgpackEncoder().encode(msg)]


def test_every_array_stays_inside_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THRESHOLD, "256")  # recorded, so that what prepare_engine_processes sets is undone after
    monkeypatch.delenv(THRESHOLD)
    msg = outputs()
    assert len(encode(msg)) > 1, "vLLM's default sends arrays as frames of their own: the case this guards"
    prepare_engine_processes(on_cuda=False)
    frames = encode(msg)
    assert len(frames) == 1 and len(frames[0]) > 64 * 1024  # one frame, over zmq's copy threshold: tracked

    from vllm.v1.serial_utils import MsgpackDecoder

    back = MsgpackDecoder(dict[str, dict[str, np.ndarray]]).decode(frames)
    for rid, want in msg.items():
        for key in ("routed_experts", "logprobs"):
            np.testing.assert_array_equal(back[rid][key], want[key])  # type: ignore[index]


def test_a_users_threshold_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THRESHOLD, "4096")
    prepare_engine_processes(on_cuda=False)
    assert os.environ[THRESHOLD] == "4096" != INLINE_ALL_ARRAYS
