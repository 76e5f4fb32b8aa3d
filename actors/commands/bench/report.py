"""What every benchmark does with its result: print it, and write it as JSON where ``--json`` says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], path: Path | None, *, print_skip: tuple[str, ...] = ()) -> None:
    """Print ``result`` (without the ``print_skip`` keys: long curves) and write all of it to ``path`` (None: not)."""
    print(json.dumps({k: v for k, v in result.items() if k not in print_skip}, indent=2))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
