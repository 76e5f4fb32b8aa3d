"""A learner checkpoint as a Hugging Face model directory (``async-rl export RUN_DIR OUT_DIR [--step N]``).

The run directory holds the learner's resolved config (``learner-config.json``: model, backend) and its
checkpoints (``checkpoints/step-<N>/``, see :mod:`actors.learner.checkpoint`). The export reads the chosen
checkpoint's weights on the CPU, in Hugging Face names, into the model architecture of ``model.name`` (a preset
or a local directory), and writes ``save_pretrained``'s files (config.json, generation_config.json,
model.safetensors), the model's tokenizer, and ``async_rl_export.json`` (where it came from: step, version,
backend). Nothing is downloaded.

* torch backend: ``backend/model.pt`` is the model's state dict, loaded as it is;
* Megatron backend: every rank's file, joined into global weights (:mod:`.megatron.checkpoint_reader`) and
  converted with the backend's own :func:`~.megatron.convert.mcore_to_hf`.

The weights keep the dtype the learner trained them in, so the export equals, bit for bit, what the learner
publishes to generators for that version (``tests/integration/test_export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from actors.learner.checkpoint import LATEST, STATE_FILE
from actors.learner.torch_backend import MODEL_FILE

CONFIG_FILE = "learner-config.json"
"""The learner's resolved config in the run directory (written at start by :func:`async_rl.entry.save_resolved_config`)."""
EXPORT_FILE = "async_rl_export.json"
"""Provenance written into the export: run directory, step, version, backend."""


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint of ``step`` under ``run_dir/checkpoints`` (None: the newest); ValueError listing those kept."""
    root = Path(run_dir) / "checkpoints"
    kept = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / STATE_FILE).is_file())  # fmt: skip
    if not kept:
        raise ValueError(f"{root} holds no complete checkpoint (step-*/{STATE_FILE})")
    if step is None:
        pointer = root / LATEST
        named = root / pointer.read_text().strip() if pointer.is_file() else None
        return named if named is not None and named in kept else kept[-1]
    path = root / f"step-{step:08d}"
    if path not in kept:
        steps = ", ".join(str(int(p.name.split("-")[1])) for p in kept)
        raise ValueError(f"--step {step}: no checkpoint of that step in {root} (kept: {steps})")
    return path


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The learner's resolved config saved in ``run_dir``."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: RUN_DIR must be a learner's run.run_dir")
    return dict(json.loads(path.read_text()))


def checkpoint_hf_weights(checkpoint: Path, run_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of ``checkpoint`` in transformers' in-memory names, on the CPU, in the dtype trained."""
    from async_rl.model.presets import load_model_config

    backend_dir = Path(checkpoint) / "backend"
    if run_config.get("backend", "torch") == "torch":
        if not (backend_dir / MODEL_FILE).is_file():
            raise ValueError(f"{backend_dir} has no {MODEL_FILE} (is the run's backend torch?)")
        state = torch.load(backend_dir / MODEL_FILE, map_location="cpu", weights_only=True)
        return {k: v.contiguous() for k, v in state.items()}
    from actors.learner.megatron.checkpoint_reader import read_global_weights
    from actors.learner.megatron.convert import ModelArch, mcore_to_hf

    arch = ModelArch.from_hf_config(load_model_config(run_config["model"]["name"]))
    return mcore_to_hf(read_global_weights(backend_dir, arch), arch, fused_experts=True)


def export_checkpoint(run_dir: Path, out_dir: Path, *, step: int | None = None) -> Path:
    """Write the checkpoint of ``step`` (None: the newest) of ``run_dir`` as a Hugging Face directory ``out_dir``."""
    from transformers import AutoModelForCausalLM

    from async_rl.model.presets import load_model_config, load_tokenizer

    run_config = read_run_config(run_dir)
    checkpoint = find_checkpoint(run_dir, step)
    weights = checkpoint_hf_weights(checkpoint, run_config)
    model_name = run_config["model"]["name"]
    config = load_model_config(model_name)
    floats = [t.dtype for t in weights.values() if t.is_floating_point()]
    if not floats:
        raise ValueError(f"{checkpoint}: no floating-point weights")
    dtype = max(set(floats), key=floats.count)  # the model's dtype; a tensor kept in another (a router) stays so
    with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if k not in _tied(model)]
    if missing or unexpected:
        raise ValueError(f"{checkpoint}: weights do not match {model_name!r}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")  # fmt: skip
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    load_tokenizer(model_name).save_pretrained(str(out_dir))
    state = json.loads((checkpoint / STATE_FILE).read_text())
    provenance = {"run_dir": str(Path(run_dir).resolve()), "checkpoint": checkpoint.name, "step": state["step"],
                  "version": state["version"], "backend": run_config.get("backend", "torch"), "model": model_name,
                  "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    (out_dir / EXPORT_FILE).write_text(json.dumps(provenance, indent=2))
    return out_dir


def _tied(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share another's storage (a tied lm_head), absent from a state dict that dedups."""
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if not isinstance(keys, dict) else set(keys)
