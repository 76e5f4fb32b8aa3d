"""Which model a process runs: :class:`ModelConfig`, torch-free (the models themselves are built in
:mod:`async_rl.model.presets`, which checks that its presets and dtypes are the ones named here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PRESET_NAMES = ("tiny-moe", "tiny-dense", "small-moe", "moe-107m", "moe-1.6b", "moe-5b")
"""Built-in random-init model presets (built by :data:`async_rl.model.presets.PRESETS`)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Parameter dtypes a model can be loaded in."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to run: a preset name or a local Hugging Face directory."""

    name: str = "tiny-moe"
    """A preset (``tiny-moe``, ``tiny-dense``, ``small-moe``) or the path of a local HF model directory."""
    seed: int = 0
    """Initialisation seed of a preset's random weights (ignored for directories)."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model.name must be a preset or a model directory")
        if self.name not in PRESET_NAMES and not Path(self.name).is_dir():
            raise ValueError(
                f"model.name {self.name!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor an existing directory"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
