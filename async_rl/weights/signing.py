"""Signed weight manifests: an HMAC-SHA256 from a run secret, so a generator applies only versions its learner wrote.

A learner with a run secret stores each manifest as ``{"signed": <manifest bytes>, "hmac": <hex>}``; a reader with
the secret decodes only manifests whose HMAC over those exact bytes checks (``hmac.compare_digest``), and refuses
unsigned ones. The manifest holds every bucket's size and checksum, so a signed manifest also pins the bytes a
reader verifies (against accidental and casual corruption: the bucket checksums are xxh3/crc32, not
cryptographic, so keep write access to the weight keys with the learner, as ``async-rl acl`` does).

The secret comes from a file (``secret_file`` of the publisher and reader configs), else the file named by
``$ASYNC_RL_RUN_SECRET_FILE``, else ``$ASYNC_RL_RUN_SECRET``; it is never logged. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

RUN_SECRET_ENV = "ASYNC_RL_RUN_SECRET"
RUN_SECRET_FILE_ENV = "ASYNC_RL_RUN_SECRET_FILE"
# 16 bytes of key is the least that is not guessable; HMAC-SHA256 takes any length.
MIN_SECRET_BYTES = 16


def run_secret(secret_file: str = "") -> bytes | None:
    """The run secret (see the module docstring), or None when none is configured."""
    path = secret_file or os.environ.get(RUN_SECRET_FILE_ENV, "")
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"run secret file {path!r} cannot be read: {exc.strerror}") from None
        source = f"run secret file {path!r}"
    else:
        value = os.environ.get(RUN_SECRET_ENV, "")
        if not value:
            return None
        secret, source = value.encode(), f"${RUN_SECRET_ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} holds {len(secret)} bytes; a run secret needs at least {MIN_SECRET_BYTES}")
    return secret


def manifest_hmac(key: bytes, body: bytes) -> str:
    """Hex HMAC-SHA256 of a manifest's bytes."""
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def hmac_matches(key: bytes, body: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(mac, manifest_hmac(key, body))
