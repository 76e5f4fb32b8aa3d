"""The optimizer's part of a Megatron rank's checkpoint file, with or without the distributed optimizer.

Without it, every rank keeps the whole fp32 master copy and Adam moments of its parameters, and megatron's
``state_dict()`` holds all of them. With it (``learner.megatron.distributed_optimizer``), each data-parallel rank keeps
only its shard of them, and megatron's ``state_dict()`` holds none: megatron saves the shards through a gather to one
rank (``save_parameter_state``) or its dist-checkpointing. Here each rank writes its own shard into its own file, keyed
by parameter name, beside the step counts and hyperparameters (``state_dict()``): no gather, no extra process group,
and a resume on the same layout reads back exactly what was written. A different layout (another data-parallel size,
another bucket split) is refused with the reason, before any tensor is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

KEY = "optimizer"
"""The checkpoint file's entry for megatron's ``state_dict()`` (hyperparameters, step counts; with the plain
optimizer, the whole state)."""
SHARDS_KEY = "optimizer_shards"
"""The entry for this rank's shards of the distributed optimizer (one per chained optimizer: dense, experts)."""


def parts(optimizer: Any) -> list[Any]:
    """The optimizers megatron chained (one for the dense parameters, one for the experts), or the one."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(p, DistributedOptimizer) for p in parts(optimizer))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone in its storage: torch.save writes a view's whole storage (an fp32 master shard of an fp32 model is
    a view of the gradient buffer's parameter copy)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.detach() if whole else t.detach().clone()


def _shard_tensors(sub: Any, names: dict[int, str]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    for param in sub.model_param_group_index_map:
        yield names[id(param)], sub._get_main_param_and_optimizer_states(param)


def _main_param(sub: Any, param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's fp32 shard of ``param`` in ``sub``'s inner optimizer, found without reading the optimizer's state."""
    group_index, group_order = sub.model_param_group_index_map[param]
    return sub.optimizer.param_groups[group_index]["params"][group_order]  # type: ignore[no-any-return]


def check_shards(subs: list[Any], shards: list[dict[str, dict[str, torch.Tensor]]], names: dict[int, str],
                 where: str) -> None:  # fmt: skip
    """ValueError unless ``shards`` hold exactly this rank's parameters, each shard of this rank's extent. Reads no
    optimizer state: torch's is a defaultdict, and an entry made by reading it tells megatron's ``load_state_dict``
    that the state exists, so that it allocates no moments and the first step after the resume fails (KeyError
    ``exp_avg``)."""
    if len(shards) != len(subs):
        raise ValueError(f"{where} has {len(shards)} optimizer shard sets, this layout builds {len(subs)} optimizers")
    for sub, shard in zip(subs, shards, strict=True):  # every shard's extent checked before anything is written
        if set(shard) != {names[id(p)] for p in sub.model_param_group_index_map}:
            raise ValueError(f"{where}: its optimizer shards name other parameters than this rank's: resume on the "
                             "layout that wrote it")  # fmt: skip
        for param in sub.model_param_group_index_map:
            name, saved = names[id(param)], shard[names[id(param)]]
            if "param" not in saved or saved["param"].shape != _main_param(sub, param).shape:
                raise ValueError(f"{where}: the optimizer shard of {name} does not match this rank's (another "
                                 "data-parallel size or layout wrote it): resume on the layout that wrote it")  # fmt: skip


def save_entries(optimizer: Any, model: torch.nn.Module) -> dict[str, Any]:
    """The checkpoint file's optimizer entries for this rank."""
    if not is_distributed(optimizer):
        return {KEY: optimizer.state_dict()}
    if all(len(sub.optimizer.state) == 0 for sub in parts(optimizer)):
        return {KEY: None, SHARDS_KEY: None}  # no step taken yet: a fresh optimizer is this state exactly
    names = {id(p): n for n, p in model.named_parameters()}
    shards = [{name: {k: _compact(v) for k, v in tensors.items()} for name, tensors in _shard_tensors(sub, names)}
              for sub in parts(optimizer)]  # fmt: skip
    return {KEY: optimizer.state_dict(), SHARDS_KEY: shards}


def load_entries(optimizer: Any, model: torch.nn.Module, entries: dict[str, Any], where: str) -> None:
    """Restore this rank's optimizer from its checkpoint file's ``entries`` (``where``: the file, for errors)."""
    distributed = is_distributed(optimizer)
    if (SHARDS_KEY in entries) != distributed:
        written = "with" if SHARDS_KEY in entries else "without"
        raise ValueError(f"{where} was written {written} the distributed optimizer; this learner runs "
                         f"learner.megatron.distributed_optimizer={str(distributed).lower()}: resume with the "
                         "setting the checkpoint was written with")  # fmt: skip
    if not distributed:
        optimizer.load_state_dict(entries[KEY])
        return
    shards = entries[SHARDS_KEY]
    if shards is None:  # written before the first step
        return
    subs = parts(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    check_shards(subs, shards, names, where)
    optimizer.load_state_dict(entries[KEY])  # step counts, hyperparameters; allocates the state it then fills
    with torch.no_grad():
        for sub in subs:  # megatron hands every parameter the same step tensor: each its own, as a step leaves them
            for st in sub.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()
        for sub, shard in zip(subs, shards, strict=True):
            for param in sub.model_param_group_index_map:
                sub._set_main_param_and_optimizer_states(param, shard[names[id(param)]])
    # The model's own weights come from the file's model entry (every rank's whole, after the step's all-gather).
