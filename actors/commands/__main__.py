"""``python -m actors.commands ...`` is ``async-rl ...`` (for images that run from a PYTHONPATH, no console script)."""

import sys

from actors.commands.cli import main

sys.exit(main())
