"""What every benchmark does with its result: name the machine, print it, and write it as JSON where ``--json``
says."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def machine(device: str) -> str:
    """The machine a result was measured on, in words: the GPU (and how many) when ``device`` is a CUDA one."""
    import torch

    cores = f"{os.cpu_count()} CPU cores"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; {cores}; {platform.platform()}"
    return f"{platform.processor() or platform.machine()}, {cores} (no GPU); {platform.platform()}"


def emit(result: dict[str, Any], path: Path | None, *, print_skip: tuple[str, ...] = ()) -> None:
    """Print ``result`` (without the ``print_skip`` keys: long curves) and write all of it to ``path`` (None: not)."""
    print(json.dumps({k: v for k, v in result.items() if k not in print_skip}, indent=2))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
