"""Entry checks against model facts, and the property that ties them to the backend: any mutation of a valid
record is either refused (WireError / EntryError naming the field) or something the backend trains on safely."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.wire import WireError, decode_group, encode_group
from buffer.entry_checks import EntryChecker, EntryError, ModelFacts
from tests.integration.poison import mutate, valid_record

FACTS = ModelFacts(vocab_size=22, max_seq_len=256, num_moe_layers=2, top_k=2, num_experts=4)


def _rec(**kw):  # type: ignore[no-untyped-def]
    return valid_record("p0", np.array([1, 2, 3], dtype=np.int32), FACTS, version=kw.pop("version", 2),
                        num_samples=kw.pop("num_samples", 3), seed=0, **kw)  # fmt: skip


def test_valid_record_passes_and_each_fact_is_enforced():
    checker = EntryChecker(FACTS, num_samples=3, max_version=2)
    checker.check(_rec())
    cases = []
    rec = _rec()
    rec.samples[1].response_ids = rec.samples[1].response_ids.copy()
    rec.samples[1].response_ids[4] = 22
    cases.append((rec, r"samples\[1\]\.response_ids\[4\] = 22 is not in the model's vocabulary \[0, 22\)"))
    rec = _rec()
    rec.prompt_ids = np.array([1, -1], dtype=np.int32)
    cases.append((rec, r"prompt_ids\[1\] = -1"))
    rec = _rec()
    rec.prompt_ids = np.zeros(0, dtype=np.int32)
    for s in rec.samples:
        s.routes = None
    cases.append((rec, "prompt_ids is empty"))
    cases.append((_rec(response_tokens=254), "3 prompt \\+ 254 response tokens exceed the model's context of 256"))
    cases.append((_rec(version=3), "version 3 is newer than the newest published version 2"))
    cases.append((_rec(num_samples=2), "2 samples, the run samples 3 per prompt"))
    for edit, msg in [
        (lambda r: r.__setitem__((0, 1, 0), 4), r"routes\[0, 1\]: expert id 4 is not below the model's 4 experts"),
        (lambda r: r.__setitem__((5, 0, 1), r[5, 0, 0]), r"routes\[5, 0\]: expert \d appears twice"),
    ]:
        rec = _rec()
        routes = rec.samples[2].routes.copy()
        edit(routes)
        rec.samples[2].routes = routes
        cases.append((rec, msg))
    rec = _rec()
    for s in rec.samples:
        s.routes = s.routes[:, :1]
    cases.append((rec, "routes for 1 MoE layers, the model has 2"))
    rec = _rec()
    for s in rec.samples:
        s.routes = np.concatenate([s.routes, (s.routes[:, :, :1] + 1) % 4], axis=2)
    cases.append((rec, "routes with top_k 3, the model routes to 2 experts per token"))
    for rec, msg in cases:
        with pytest.raises(EntryError, match=msg):
            checker.check(decode_group(encode_group(rec)))  # as the reader sees it: read-only views
    dense = EntryChecker(ModelFacts(vocab_size=22, max_seq_len=256))
    with pytest.raises(EntryError, match="model is dense, but the sample carries MoE routes"):
        dense.check(_rec())
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        ModelFacts(vocab_size=10, max_seq_len=8, num_moe_layers=2, top_k=3, num_experts=2)


def test_loss_mask_must_leave_the_model_a_token():
    """An episode's mask (environment tokens 0) passes; one that leaves no model token in a response is refused."""
    checker = EntryChecker(FACTS, num_samples=3, max_version=2)
    rec = _rec()
    n = rec.samples[0].response_ids.size
    rec.samples[0].loss_mask = np.array([1] * 2 + [0] * (n - 2), dtype=np.uint8)
    checker.check(decode_group(encode_group(rec)))
    rec.samples[1].loss_mask = np.zeros(rec.samples[1].response_ids.size, dtype=np.uint8)
    with pytest.raises(EntryError, match=r"samples\[1\]\.loss_mask: none of the \d+ response tokens is the model's"):
        checker.check(decode_group(encode_group(rec)))


def test_facts_from_the_preset_configs():
    from async_rl.model.presets import load_model_config

    moe = ModelFacts.from_hf_config(load_model_config("tiny-moe"))
    assert (moe.vocab_size, moe.max_seq_len, moe.num_moe_layers, moe.top_k, moe.num_experts) == (22, 256, 2, 2, 4)
    assert ModelFacts.from_hf_config(load_model_config("tiny-dense")).num_moe_layers == 0


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from actors.learner.config import TorchBackendConfig
    from actors.learner.torch_backend import TorchBackend
    from async_rl.model.presets import load_model

    return TorchBackend(load_model("tiny-moe", seed=0), TorchBackendConfig(device="cpu"))


BASE = encode_group(valid_record("p0", np.array([3, 4, 5, 6], dtype=np.int32), FACTS, version=1, num_samples=2,
                                 seed=1, episode=True))  # fmt: skip  (loss masks are mutated too)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_is_refused_or_safe_for_the_backend(backend, data):  # type: ignore[no-untyped-def]
    from actors.learner.batching import make_micro_batches
    from actors.learner.config import LearnerConfig
    from actors.learner.samples import build_samples

    mutated = mutate(BASE, data.draw)
    try:
        rec = decode_group(mutated)
        EntryChecker(FACTS, num_samples=2, max_version=1).check(rec)
    except (WireError, EntryError):
        return
    samples, _, _ = build_samples([rec], LearnerConfig(batch_groups=1))
    for mb in make_micro_batches(samples, LearnerConfig().batching):
        out = backend.forward_logprobs(mb, replay_routes=True)
        assert out.logprobs.shape == mb.input_ids.shape
