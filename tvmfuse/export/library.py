"""Export stage: write `model.so` and `manifest.json` into `<out>/<name>-<target>/`, atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from tvmfuse.errors import JobError
from tvmfuse.export.digest import sha256_of
from tvmfuse.export.weights import write_weights

MANIFEST = "manifest.json"
#: the export layout's version: 2 added "weights" (embedded in model.so, or a tensor cache in weights/);
#: exports without "format" are 1 (weights always embedded)
FORMAT = 2
LIBRARY = "model.so"


def export_dir(out: str, name: str, target_name: str) -> str:
    """`<out>/<name>-<target>`, refusing any name that would land outside `out`."""
    check_safe_name(name)
    root = os.path.realpath(out)
    path = os.path.realpath(os.path.join(root, f"{name}-{target_name}"))
    if os.path.dirname(path) != root:
        raise JobError(f"job name {name!r} would write outside --out {out}")
    return path


def check_safe_name(name: str) -> None:
    if not name or name in {".", ".."} or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise JobError(f"invalid model or job name {name!r}: use letters, digits, '-', '_' and '.', "
                       "not a path")


def export(executable, manifest: dict, dest: str, extra_files: dict[str, str] | None = None,
           weights: list | None = None, late=None) -> str:
    """Write the library and manifest to a temporary folder beside `dest`, then move it into place. `weights`
    (main's weight parameters, tvmfuse.weights.unbind_weights): stored beside the library in weights/ (manifest
    "weights": every file's sha256); None: the library embeds them (manifest "weights": {"storage": "embedded"}). `late()`: manifest entries
    known only once the rest is written (the build's peak memory)."""
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=parent)
    try:
        lib = os.path.join(tmp, LIBRARY)
        executable.export_library(lib)
        stored = write_weights(tmp, weights) if weights is not None else {"storage": "embedded"}
        manifest = {**manifest, "format": FORMAT, "library": LIBRARY, "sha256": sha256_of(lib), "weights": stored,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        manifest.update(late() if late else {})
        for fname, text in (extra_files or {}).items():
            with open(os.path.join(tmp, fname), "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _replace_dir(src: str, dest: str) -> None:
    """Move `src` to `dest`; an older export there is swapped out first and removed after."""
    old = None
    if os.path.exists(dest):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.old.", dir=os.path.dirname(dest))
        os.replace(dest, os.path.join(old, "prev"))
    os.replace(src, dest)
    if old:
        shutil.rmtree(old, ignore_errors=True)
