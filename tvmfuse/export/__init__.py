"""Export stage: `model.so`, `manifest.json` and the fusion report into `<out>/<name>-<target>/`, atomically; and
loading an export back (sha256 checked)."""

from tvmfuse.export.library import LIBRARY, MANIFEST, export, export_dir
from tvmfuse.export.manifest import make_manifest
from tvmfuse.export.runtime import LoadedModel, load

__all__ = ["LIBRARY", "MANIFEST", "LoadedModel", "export", "export_dir", "load", "make_manifest"]
