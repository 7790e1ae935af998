"""Keep TVMScript's `inspect.stack()` from rescanning every loaded module on each frozen import frame."""

import inspect

# TVMScript's @T.prim_func calls inspect.stack(), which looks up the module of every frame whose file is not on disk
# (the import machinery's frozen frames) by scanning all of sys.modules, uncached. Importing tvm.s_tir.tensor_intrin
# (~500 prim_funcs; MetaSchedule's CUDA tensor-core rules and tvmfuse's GEMM spaces import it) took 34 s in a fresh
# process and 73-96 s once torch and transformers were loaded (~3800 modules). Recording that these files belong to no
# module (what the scan finds) makes that import ~10 s; nothing else changes (inspect gets no source for them either way).
FROZEN_FRAME_FILES = tuple(f"<frozen {name}>" for name in (
    "importlib._bootstrap", "importlib._bootstrap_external", "runpy", "zipimport"))
NO_MODULE = "<no module: frozen>"


def install() -> None:
    """Map the frozen frames' file names to no module in inspect's cache (idempotent; real entries are kept)."""
    for name in FROZEN_FRAME_FILES:
        inspect.modulesbyfile.setdefault(name, NO_MODULE)
