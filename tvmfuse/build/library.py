"""The compiled executable linked once into a shared library, which verification loads and the export copies."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import tvm


class LinkedLibrary:
    """`executable` linked into a shared library in a private temporary folder, before any VM runs it.

    TVM 0.27's VirtualMachine, created on an executable, records an empty memory scope for each of its constants in
    that executable (`exec_->memory_scopes[i]` in src/runtime/vm/vm.cc inserts them); an export made afterwards
    serializes those entries and every loader of the library then logs a `Scope Loaded:` warning per constant.
    Linked here, the library holds none; `module` (loaded on first use, so a CUDA build links on a machine without a
    GPU) is what verification runs, the very file that `export_library` then copies into the export."""

    def __init__(self, executable):
        self.folder = tempfile.mkdtemp(prefix="tvmfuse-link-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)  # a failed job leaves nothing
        self.path = os.path.join(self.folder, "model.so")
        executable.export_library(self.path)
        self._module = None

    @property
    def module(self) -> tvm.runtime.Module:
        """The library loaded (once) as a runtime module, for `relax.VirtualMachine`."""
        if self._module is None:
            self._module = tvm.runtime.load_module(self.path)
        return self._module

    def export_library(self, path: str) -> None:
        """Put the linked library at `path` (a copy: verification may still hold the loaded one)."""
        shutil.copyfile(self.path, path)
