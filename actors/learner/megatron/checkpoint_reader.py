"""A Megatron learner checkpoint read back on the CPU, without megatron-core: the global weights of all ranks.

The backend saves one ``megatron_rank{r:05d}.pt`` per rank (its module state dict and optimizer) and, beside it,
``megatron_rank{r:05d}.json``: the rank's :class:`~.convert.RankNaming` and its tensor- and expert-tensor-parallel
ranks (:func:`write_rank_layout`). :func:`read_global_weights` maps every rank's parameter names to global names
with :func:`~.convert.global_name`, takes one replica of each slice (data-parallel copies are equal), joins the
tensor-parallel slices with :func:`~.convert.unshard`, and returns the global megatron state dict that
:func:`~.convert.mcore_to_hf` turns into Hugging Face weights: the same conversion the backend's export runs.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import types
from pathlib import Path

import torch

from actors.learner.megatron.convert import (
    GLOBAL_EXPERT_NAME,
    LAYER_NAME,
    ModelArch,
    RankNaming,
    expected_global_names,
    global_name,
    tp_kind,
    unshard,
)
from actors.learner.megatron.spec import STACKED_EXPERTS

RANK_FILE = "megatron_rank{rank:05d}.pt"
"""A rank's saved state: ``{"model": module state dict, "optimizer": ...}``."""
LAYOUT_FILE = "megatron_rank{rank:05d}.json"
"""A rank's place in the parallel layout (:func:`write_rank_layout`)."""


def write_rank_layout(directory: Path, rank: int, naming: RankNaming, *, tp_rank: int, tp_size: int, etp_rank: int,
                      etp_size: int) -> Path:  # fmt: skip
    """Write ``megatron_rank{rank}.json`` beside the rank's state: what a reader needs to put its slices back."""
    path = Path(directory) / LAYOUT_FILE.format(rank=rank)
    layout = {"naming": dataclasses.asdict(naming), "tp_rank": tp_rank, "tp_size": tp_size, "etp_rank": etp_rank,
              "etp_size": etp_size}  # fmt: skip
    path.write_text(json.dumps(layout))
    return path


def read_global_weights(directory: Path, arch: ModelArch) -> dict[str, torch.Tensor]:
    """The global megatron state dict of the checkpoint in ``directory`` (every rank's file), on the CPU.

    ValueError when a rank's layout file is missing (a checkpoint written before layouts were saved) or when the
    ranks do not cover every weight of ``arch``."""
    directory = Path(directory)
    ranks = sorted(directory.glob("megatron_rank*.pt"))
    if not ranks:
        raise ValueError(f"{directory} holds no Megatron rank files (megatron_rank*.pt)")
    expected = set(expected_global_names(arch))  # the weights; a state dict also holds buffers (rotary, TE state...)
    slices: dict[str, dict[int, torch.Tensor]] = {}  # global name -> tp (or etp) rank -> slice
    sizes: dict[str, int] = {}
    for pt in ranks:
        layout_path = pt.with_suffix(".json")
        if not layout_path.is_file():
            raise ValueError(f"{pt} has no {layout_path.name}: the checkpoint predates rank layouts; "
                             "resume it with this version's learner and let it checkpoint once")  # fmt: skip
        layout = json.loads(layout_path.read_text())
        naming = RankNaming(**layout["naming"])
        state = torch.load(pt, map_location="cpu", weights_only=False, pickle_module=_lenient_pickle)["model"]
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or "_extra_state" in name:
                continue
            for local, t in _expand_grouped(name, tensor):
                g = global_name(local, naming, arch.moe_layers)
                if g is None or g not in expected or (g == "output_layer.weight" and arch.tie_embeddings):
                    continue
                m = LAYER_NAME.match(g)
                expert = m is not None and GLOBAL_EXPERT_NAME.match(m.group(2)) is not None
                rank, size = (layout["etp_rank"], layout["etp_size"]) if expert else (layout["tp_rank"], layout["tp_size"])
                if tp_kind(g) == "replicated":
                    rank, size = 0, 1
                slices.setdefault(g, {}).setdefault(rank, t.detach().clone())
                sizes[g] = size
    glob: dict[str, torch.Tensor] = {}
    for g, parts in slices.items():
        if sorted(parts) != list(range(sizes[g])):
            raise ValueError(f"{g}: slices of tensor-parallel ranks {sorted(parts)} of {sizes[g]} in {directory}")
        glob[g] = unshard(g, [parts[r] for r in range(sizes[g])]) if sizes[g] > 1 else parts[0]
    missing = sorted(expected - set(glob) - ({"output_layer.weight"} if arch.tie_embeddings else set()))
    if missing:
        raise ValueError(f"{directory}: the rank files lack {len(missing)} weights, e.g. {missing[:3]}")
    return glob


class _Absent:
    """Stands for an object of a class this host cannot import (megatron-core's, in the optimizer state): the
    reader needs only the model's tensors, so an export runs where megatron-core is not installed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        try:
            return super().find_class(module, name)  # type: ignore[no-any-return]
        except (ImportError, AttributeError):
            return _Absent


_lenient_pickle = types.SimpleNamespace(__name__="pickle", Unpickler=_LenientUnpickler, load=pickle.load,
                                        dump=pickle.dump, Pickler=pickle.Pickler)  # fmt: skip
"""``torch.load``'s pickle module for rank files: unknown classes load as :class:`_Absent`."""


def _expand_grouped(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stacked grouped-experts weight (``experts.weight1 [E, ...]``, see :mod:`.spec`) as per-expert
    ``local_experts.{e}`` names that :func:`~.convert.global_name` reads; any other entry as it is."""
    m = STACKED_EXPERTS.match(name)
    if m is None:
        return [(name, tensor)]
    fc = "linear_fc1" if m.group(2) == "1" else "linear_fc2"
    return [(f"{m.group(1)}local_experts.{e}.{fc}.weight", tensor[e]) for e in range(tensor.shape[0])]
