"""inspect_cache: frozen import frames are answered from inspect's cache, not by scanning sys.modules."""

import inspect
import json
import subprocess
import sys
import types

import tvmfuse  # noqa: F401  pylint: disable=unused-import
from tvmfuse import inspect_cache


class _CountingModule(types.ModuleType):
    reads = 0

    @property
    def __file__(self):  # what inspect.getmodule's scan reads for every module it visits
        type(self).reads += 1
        return "/nonexistent/counting_module.py"


def test_frozen_frames_are_answered_without_scanning_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "tvmfuse_counting_module", _CountingModule("tvmfuse_counting_module"))
    code = compile("pass", inspect_cache.FROZEN_FRAME_FILES[0], "exec")
    _CountingModule.reads = 0
    assert inspect.getmodule(code, inspect_cache.FROZEN_FRAME_FILES[0]) is None
    assert _CountingModule.reads == 0
    # without the entry the same lookup scans every module (what the cache spares), and still finds none
    monkeypatch.delitem(inspect.modulesbyfile, inspect_cache.FROZEN_FRAME_FILES[0])
    assert inspect.getmodule(code, inspect_cache.FROZEN_FRAME_FILES[0]) is None
    assert _CountingModule.reads > 0


def test_importing_tvmfuse_installs_the_entries_and_keeps_real_ones():
    script = ("import inspect, json; inspect.modulesbyfile['<frozen runpy>'] = 'runpy'; import tvmfuse.inspect_cache as c;"
              "print(json.dumps({f: inspect.modulesbyfile.get(f) for f in c.FROZEN_FRAME_FILES}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    expected = {f: inspect_cache.NO_MODULE for f in inspect_cache.FROZEN_FRAME_FILES}
    expected["<frozen runpy>"] = "runpy"
    assert json.loads(out) == expected
