"""The registry of bucket transports: a config names a scheme without importing its transport; each scheme's
module registers it; an unknown scheme or a bad URL is refused with ``transport.url`` named."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from async_rl.weights.transport import _FACTORIES, SCHEMES, TransportConfig

_PROBE = """
import json, sys
from async_rl.weights.transport import TransportConfig
for url in ("", "redis://h:1/0", "rediss://h:1/0", "shm:///dev/shm", "peer://0.0.0.0:0?fanout=2"):
    TransportConfig(url=url)
print(json.dumps(sorted(m for m in sys.modules if m.endswith("_transport") or m.endswith(".peer.transport")
                        or m.split(".")[0] in ("torch", "redis", "msgpack"))))
"""


def test_a_config_imports_no_transport_module() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_each_scheme_module_registers_its_scheme() -> None:
    for scheme, entry in SCHEMES.items():
        importlib.import_module(entry.module)
        assert scheme in _FACTORIES, f"{entry.module} does not register {scheme!r}"


def test_unknown_schemes_and_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match=r"transport.url scheme 'cuda' is not one of \['redis', 'rediss', 'shm'"):
        TransportConfig(url="cuda://0")
    with pytest.raises(ValueError, match="transport.url .* unknown parameter"):
        TransportConfig(url="peer://0.0.0.0:0?fan_out=2")
