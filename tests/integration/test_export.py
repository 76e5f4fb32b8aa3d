"""``async-rl export``: a learner checkpoint as a Hugging Face directory that transformers loads, with the learner's
logprobs and, bit for bit, the weights the learner publishes to generators (real Redis, real publisher/reader)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.commands.export import main as export_main
from actors.learner.batching import collate, make_micro_batches
from actors.learner.build import build_backend
from actors.learner.checkpoint import CheckpointManager, LearnerState
from actors.learner.config import BatchingConfig, LearnerConfig
from actors.learner.hf_export import EXPORT_FILE, find_checkpoint
from actors.learner.megatron.checkpoint_reader import LAYOUT_FILE, RANK_FILE, write_rank_layout
from actors.learner.megatron.convert import ModelArch, RankNaming, hf_to_mcore, local_state
from actors.learner.megatron.routes import PipelineSplit
from actors.learner.torch_backend import TorchBackend
from async_rl.algorithms.batch import ForwardOutput, MicroBatch, TrainSample
from async_rl.config.configurable import load_config
from async_rl.entry import save_resolved_config
from async_rl.model import toy_tokenizer as toy_tok
from async_rl.model.presets import build_model, preset_config, save_pretrained_dir
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.redis_transport import RedisTransport


def _samples(n: int, seed: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 6)), int(rng.integers(3, 9))
        out.append(TrainSample(
            input_ids=rng.integers(4, toy_tok.VOCAB_SIZE, p + r).astype(np.int32), prompt_len=p,
            behaviour_logprobs=(-rng.random(r) * 3).astype(np.float32), versions=np.zeros(r, np.int32),
            advantages=rng.standard_normal(r).astype(np.float32), group_id=f"g{i}",
        ))  # fmt: skip
    return out


def _pg_loss(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb.loss_mask.float()
    return -(out.logprobs * mb.advantages * mask).sum() / mb.step_num_tokens, {}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def _learner_config(run_dir: Path, *overrides: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, [f"run.run_dir={run_dir}", "model.name=tiny-moe", "torch.device=cpu",
                                             "torch.lr=0.01", *overrides])  # fmt: skip


async def test_torch_export_loads_with_learner_logprobs_and_published_bits(
    tmp_path: Path, servers: ServerSet, names: Names, redis_client: aioredis.Redis
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    cfg = _learner_config(run_dir)
    save_resolved_config(cfg, run_dir, "learner")
    backend = build_backend(cfg)
    assert isinstance(backend, TorchBackend)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep=2)
    for step in (1, 2):  # two checkpoints: --step picks the older one
        backend.train_step(make_micro_batches(_samples(4, seed=step), BatchingConfig()), _pg_loss)
        checkpoints.save(backend, LearnerState(step=step, version=step))
    assert find_checkpoint(run_dir).name == "step-00000002"

    assert export_main([str(run_dir), str(out)]) == 0
    assert json.loads((out / EXPORT_FILE).read_text())["step"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    mb = collate(_samples(3, seed=9), step_num_tokens=1, step_num_sequences=1)
    want = backend.forward_logprobs(mb).logprobs
    got = TorchBackend(loaded, backend.config).forward_logprobs(mb).logprobs  # same temperature and token mask
    assert torch.equal(got, want)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok("12+3=", add_special_tokens=False).input_ids == toy_tok.encode("12+3=")

    # What generators receive for this version, through the real publisher and reader: the state-dict names
    # equal the loaded model's tensors, the checkpoint names (vLLM's) equal the safetensors file, bit for bit.
    transport = RedisTransport(servers.redis_url, names)
    try:
        publisher, reader = WeightPublisher(redis_client, transport, names), WeightReader(redis_client, transport, names)
        await publisher.publish(dict(backend.export_weights()), 2)
        _same_bits((await reader.fetch()).tensors, {k: v.detach() for k, v in loaded.state_dict().items()})
        backend.config = dataclasses.replace(backend.config, export_format="checkpoint")
        await publisher.publish(dict(backend.export_weights()), 3)
        _same_bits((await reader.fetch(3)).tensors, load_file(str(out / "model.safetensors")))
    finally:
        for v in (2, 3):
            await transport.delete(v, 64)
        await transport.close()

    older = tmp_path / "hf-step1"
    assert export_main([str(run_dir), str(older), "--step", "1"]) == 0
    assert not torch.equal(load_file(str(older / "model.safetensors"))["lm_head.weight"],
                           load_file(str(out / "model.safetensors"))["lm_head.weight"])  # fmt: skip
    assert export_main([str(run_dir), str(tmp_path / "x"), "--step", "7"]) == 1  # "kept: 1, 2"


_STAND_IN = types.ModuleType("megatron_stand_in")
_STAND_IN.OptimizerState = type("OptimizerState", (), {"__module__": "megatron_stand_in"})  # type: ignore[attr-defined]


def _write_megatron_checkpoint(run_dir: Path, model: torch.nn.Module, *, tp: int, pp: int, ep: int,
                               te_spec: bool) -> None:  # fmt: skip
    """The files MegatronBackend.save writes for a TP x PP x EP layout (one per rank: the rank's own parameter names
    and slices, and its layout), built with the conversion's local_state as the backend's load does."""
    arch = ModelArch.from_hf_config(model.config)
    glob = hf_to_mcore({k: v.detach().clone() for k, v in model.state_dict().items()}, arch)
    split = PipelineSplit(num_layers=arch.num_layers, pp_size=pp)
    local_experts = arch.num_experts // ep
    ckpt = run_dir / "checkpoints" / "step-00000003"
    (ckpt / "backend").mkdir(parents=True)
    rank = 0
    for stage in range(pp):
        for r in range(tp * ep):  # data-parallel size ep: experts fold into the same ranks
            tp_rank, ep_rank = r % tp, r // tp
            naming = RankNaming(layer_offset=split.offset(stage), num_local_layers=split.num_layers_on(stage),
                                expert_offset=ep_rank * local_experts, num_local_experts=local_experts,
                                te_spec=te_spec, grouped_experts=te_spec, has_embedding=stage == 0,
                                has_output=stage == pp - 1)  # fmt: skip
            local = local_state(glob, naming, arch, tp_rank, tp)
            local["decoder.final_layernorm._extra_state"] = torch.zeros(0)  # TE's extra state: not a weight
            local["rotary_pos_emb.inv_freq"] = torch.ones(4)  # a buffer: not a weight either
            # The optimizer state holds objects of megatron-core's classes, which the exporting host may lack: a
            # module that exists only while saving stands for it.
            sys.modules[_STAND_IN.__name__] = _STAND_IN
            try:
                torch.save({"model": local, "optimizer": {"state": _STAND_IN.OptimizerState()}},
                           ckpt / "backend" / RANK_FILE.format(rank=rank))  # fmt: skip
            finally:
                del sys.modules[_STAND_IN.__name__]
            write_rank_layout(ckpt / "backend", rank, naming, tp_rank=tp_rank, tp_size=tp, etp_rank=0, etp_size=1)
            rank += 1
    (ckpt / "state.json").write_text(json.dumps({"step": 3, "version": 3, "prompts_issued": 0,
                                                 "published_version": 3, "extra": {}}))  # fmt: skip
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)


@pytest.mark.parametrize(("te_spec", "tied"), [(False, False), (True, False), (False, True)])
def test_megatron_checkpoint_exports_the_model_bit_for_bit(tmp_path: Path, te_spec: bool, tied: bool) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    model = build_model(preset_config("tiny-moe", tie_word_embeddings=tied), seed=3)
    name = str(save_pretrained_dir(tmp_path / "model", model)) if tied else "tiny-moe"  # tied: a model directory
    cfg = _learner_config(run_dir, "backend=megatron", f"model.name={name}")
    save_resolved_config(cfg, run_dir, "learner")
    _write_megatron_checkpoint(run_dir, model, tp=2, pp=2, ep=2, te_spec=te_spec)
    assert export_main([str(run_dir), str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    _same_bits({k: v.detach() for k, v in loaded.state_dict().items()},
               {k: v.detach() for k, v in model.state_dict().items()})  # fmt: skip
    ids = torch.tensor([[toy_tok.BOS_ID, *toy_tok.encode("31415=")]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)

    (run_dir / "checkpoints" / "step-00000003" / "backend" / LAYOUT_FILE.format(rank=1)).unlink()
    assert export_main([str(run_dir), str(tmp_path / "again")]) == 1  # names the missing layout file
