"""The sha256 of an exported file, as the manifest records it and loading checks it."""

from __future__ import annotations

import hashlib


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
