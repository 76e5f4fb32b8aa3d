"""``async-rl export`` of a real Megatron checkpoint (one GPU; megatron-core on PYTHONPATH): the directory loads in
transformers with exactly the weights the backend publishes, and the backend's logprobs.

Run on the device: ``python -m pytest -q -m gpu tests/gpu/test_megatron_export.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

LP_TOL = 2e-4
"""As tests/gpu/test_megatron_backend.py: float32, TF32 off, the same routes; megatron vs HF reduction order."""


@pytest.fixture(scope="module", autouse=True)
def _setup():  # type: ignore[no-untyped-def]
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core is not installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_megatron_checkpoint_exports_the_published_weights(tmp_path, experts: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from actors.commands.export import main as export_main
    from actors.learner.checkpoint import CheckpointManager, LearnerState
    from actors.learner.config import LearnerConfig, TorchBackendConfig
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes
    from actors.learner.torch_backend import TorchBackend
    from async_rl.config.configurable import load_config
    from async_rl.entry import save_resolved_config
    from async_rl.model.toy_tokenizer import save_tokenizer

    cfg = toy_config()
    hf = build_hf(cfg)
    model_dir, run_dir, out = tmp_path / "model", tmp_path / "run", tmp_path / "hf"
    hf.save_pretrained(str(model_dir))
    save_tokenizer(model_dir)
    lcfg = load_config(LearnerConfig, None, [f"run.run_dir={run_dir}", f"model.name={model_dir}", "backend=megatron",
                                             "megatron.dtype=float32", f"megatron.experts={experts}"])  # fmt: skip
    save_resolved_config(lcfg, run_dir, "learner")
    mb = make_batch(cfg, [48, 30], seed=8)
    mb = with_routes(mb, hf_routes(hf, mb))
    mcfg = MegatronConfig(dtype="float32", recompute=False, lr=1e-3, experts=experts)
    meg = MegatronBackend(mcfg, hf.config, {k: v.detach().float().cpu() for k, v in hf.state_dict().items()})
    try:
        for _ in range(2):
            meg.train_step([mb], nll_loss, replay_routes=True)
        want = meg.forward_logprobs(mb, replay_routes=True).logprobs
        published = dict(meg.export_weights())
        CheckpointManager(run_dir / "checkpoints").save(meg, LearnerState(step=2, version=2))
    finally:
        meg.close()
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step-00000002" / "backend").iterdir()) == [
        "megatron_rank00000.json", "megatron_rank00000.pt"]  # fmt: skip
    assert export_main([str(run_dir), str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    got = {k: v.detach() for k, v in loaded.state_dict().items()}
    assert sorted(got) == sorted(published)
    for k, v in published.items():
        assert v.dtype == got[k].dtype and torch.equal(v, got[k]), k
    lp = TorchBackend(loaded.to("cuda").eval(), TorchBackendConfig(device="cuda")).forward_logprobs(mb).logprobs
    m = mb.attention_mask.clone()
    m[:, 0] = False
    d = float((lp - want).abs()[m].max())
    print(f"megatron ({experts}) -> export -> transformers: max|dlp|={d:.3e}")
    assert d < LP_TOL
