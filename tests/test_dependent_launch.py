"""kernels/dependent_launch.py and build/dependent_launch.py: the Hopper kernels wait for their predecessor before
they touch global memory, and exactly the kernels that wait are launched with programmatic dependent launch."""

from __future__ import annotations

import pytest
import tvm
from checks import cuda_sources
from test_hopper import _gelu_projection
from tvm.script import tirx as T
from tvm.tirx.build import split_host_device_mods

from tvmfuse.build.compile import TIR_PIPELINE, compile_module
from tvmfuse.build.dependent_launch import TAG, with_dependent_launch
from tvmfuse.kernels.dependent_launch import SWITCH
from tvmfuse.kernels.hopper.select import apply_hopper_kernels
from tvmfuse.spaces.defaults import apply_default_schedules
from tvmfuse.targets import resolve_target


def _launch_params(func: tvm.tirx.PrimFunc) -> dict[str, list[str]]:
    """Each device kernel of `func` lowered through tvmfuse's TIR pipeline, with its launch parameters."""
    cuda = resolve_target("cuda")
    mod = tvm.IRModule({"main": func.with_attr("target", tvm.target.Target(cuda, host="llvm"))})
    lower, _host, device = tvm.tirx.get_tir_pipeline(TIR_PIPELINE)
    _, by_target = split_host_device_mods(lower(mod))
    return {gv.name_hint: [str(t) for t in f.attrs["tirx.kernel_launch_params"]]
            for dev in by_target.values() for gv, f in device()(dev).functions.items()}


def _kernel(waits: bool) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def main(a: T.Buffer((256,), "float32")):
        T.device_entry()
        bid = T.cta_id([2])
        tx = T.thread_id([128])
        if waits:
            if tx < 64:  # found below the top level too
                T.ptx.griddepcontrol.wait()
        a[bid * 128 + tx] = T.float32(2)
    return main.with_attrs({"global_symbol": "main", "tirx.noalias": True, "tvmfuse.tirx": "test"})


def test_a_kernel_that_waits_is_launched_dependent_and_one_that_does_not_is_not():
    assert _launch_params(_kernel(True)) == {"main_kernel": ["blockIdx.x", "threadIdx.x", TAG]}
    assert _launch_params(_kernel(False)) == {"main_kernel": ["blockIdx.x", "threadIdx.x"]}


def test_the_tag_goes_before_the_dynamic_shared_memory_tag_and_only_once():
    func = _kernel(True).with_attr("tirx.kernel_launch_params", ["blockIdx.x", "threadIdx.x",
                                                                  "tirx.use_dyn_shared_memory"])
    tagged = with_dependent_launch(func)
    assert [str(t) for t in tagged.attrs["tirx.kernel_launch_params"]] == [
        "blockIdx.x", "threadIdx.x", TAG, "tirx.use_dyn_shared_memory"]
    assert with_dependent_launch(tagged).same_as(tagged)


def _gemm_source(rows: int) -> str:
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_gelu_projection(rows, 512, 384), cuda, lambda _: None), cuda), cuda))
    return src.split("__global__")[-1]


@pytest.mark.parametrize("rows, first_global", [(256, "cp_async_bulk_tensor_g2s"),  # wgmma: TMA loads
                                                (16, "tvmfuse_ld_stream(")])  # small M: streamed weight loads
def test_the_hopper_gemms_wait_before_their_first_global_access_and_release_the_next(rows, first_global):
    kernel = _gemm_source(rows)
    wait, release = kernel.find("griddepcontrol_wait()"), kernel.find("griddepcontrol_launch_dependents()")
    assert 0 < wait < release < kernel.find(first_global), kernel[:3000]
    assert kernel.count("griddepcontrol_wait()") == 1


def test_the_switch_builds_kernels_that_neither_wait_nor_release(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    assert "griddepcontrol" not in _gemm_source(256)
