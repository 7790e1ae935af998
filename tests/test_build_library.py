"""build.library: the executable linked once, before any VM runs it; the exported copy loads without TVM's
per-constant 'Scope Loaded:' warnings and its folder goes with the object."""

from __future__ import annotations

import gc
import os

import numpy as np
import tvm
from tvm import relax

from tvmfuse.build.library import LinkedLibrary


def _executable():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4], "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.add(x, relax.const(np.arange(4, dtype="float32")))))
    return tvm.compile(bb.get(), target="llvm")


def test_the_exported_library_runs_and_loads_without_scope_lines_after_a_vm_ran_it(tmp_path, capfd):
    library = LinkedLibrary(_executable())
    vm = relax.VirtualMachine(library.module, tvm.cpu())  # as verification runs it
    out = vm["main"](tvm.runtime.tensor(np.ones(4, "float32"))).numpy()
    np.testing.assert_array_equal(out, np.arange(4) + 1)
    library.export_library(str(tmp_path / "model.so"))
    capfd.readouterr()
    again = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "model.so")), tvm.cpu())
    np.testing.assert_array_equal(again["main"](tvm.runtime.tensor(np.ones(4, "float32"))).numpy(), out)
    assert "Scope Loaded:" not in capfd.readouterr().err


def test_the_control_an_executable_exported_after_a_vm_ran_it_logs_scope_lines(tmp_path, capfd):
    """What LinkedLibrary avoids (TVM 0.27); once this fails, TVM has fixed it and the class can go."""
    executable = _executable()
    relax.VirtualMachine(executable, tvm.cpu())
    executable.export_library(str(tmp_path / "model.so"))
    capfd.readouterr()
    tvm.runtime.load_module(str(tmp_path / "model.so"))
    assert "Scope Loaded:" in capfd.readouterr().err


def test_the_private_folder_is_removed_with_the_object():
    library = LinkedLibrary(_executable())
    folder = library.folder
    assert os.path.isfile(os.path.join(folder, "model.so"))
    del library
    gc.collect()
    assert not os.path.exists(folder)
