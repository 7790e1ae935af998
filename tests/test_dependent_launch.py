"""kernels/dependent_launch.py and build/dependent_launch.py: with the switch on, the Hopper kernels wait for their
predecessor before they touch global memory and every other kernel waits first; exactly the kernels that wait are
launched with programmatic dependent launch; on by default for sm_90 and newer, never for older archs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
from checks import cuda_sources
from test_hopper import _gelu_projection, _nvcc_fatbin
from tvm import relax
from tvm.script import tirx as T
from tvm.tirx.build import split_host_device_mods

from tvmfuse.build.compile import TIR_PIPELINE, compile_module
from tvmfuse.build.dependent_launch import TAG, applies_to, with_dependent_launch
from tvmfuse.fuse.fusion import lower
from tvmfuse.kernels.dependent_launch import (EARLY_WEIGHTS_SWITCH, SWITCH, WGMMA_SWITCH, dependent_launch,
                                               dependent_launch_off, early_weights, release_late, wgmma_waits)
from tvmfuse.kernels.hopper.mma_smallm import RING_SWITCH
from tvmfuse.kernels.hopper.select import apply_hopper_kernels
from tvmfuse.spaces.defaults import apply_default_schedules
from tvmfuse.targets import resolve_target


def _launch_params(func: tvm.tirx.PrimFunc, arch: str = "sm_90a") -> dict[str, list[str]]:
    """Each device kernel of `func` lowered through tvmfuse's TIR pipeline for `arch`, with its launch parameters."""
    cuda = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod = tvm.IRModule({"main": func.with_attr("target", tvm.target.Target(cuda, host="llvm"))})
    lower_tir, _host, device = tvm.tirx.get_tir_pipeline(TIR_PIPELINE)
    _, by_target = split_host_device_mods(lower_tir(mod))
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


def test_a_kernel_that_waits_is_launched_dependent_and_one_that_does_not_is_not(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    assert _launch_params(_kernel(True)) == {"main_kernel": ["blockIdx.x", "threadIdx.x", TAG]}
    assert _launch_params(_kernel(False)) == {"main_kernel": ["blockIdx.x", "threadIdx.x"]}


def test_by_default_a_generic_kernel_waits_at_its_top_and_is_launched_dependent(monkeypatch):
    """The kernels TVM schedules (no griddepcontrol of their own) wait before anything else, so that no kernel of a
    graph breaks the chain of dependent launches."""
    monkeypatch.delenv(SWITCH, raising=False)
    assert _launch_params(_kernel(False)) == {"main_kernel": ["blockIdx.x", "threadIdx.x", TAG]}
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(_gelu_projection(256, 512, 384), cuda), cuda))
    kernel = src.split("__global__")[-1]  # dlight's GEMM (no Hopper kernel asked for)
    body = kernel[kernel.index("{"):]
    assert body.index("griddepcontrol_wait()") < body.index("griddepcontrol_launch_dependents()") < body.index("[")


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
def test_the_hopper_gemms_wait_before_their_first_global_access_and_release_the_next(rows, first_global,
                                                                                       monkeypatch):
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(WGMMA_SWITCH, "1")  # (the wgmma GEMM waits only when asked)
    kernel = _gemm_source(rows)
    wait, release = kernel.find("griddepcontrol_wait()"), kernel.find("griddepcontrol_launch_dependents()")
    assert 0 < wait < release < kernel.find(first_global), kernel[:3000]
    assert kernel.count("griddepcontrol_wait()") == 1


def test_late_release_lets_the_next_kernel_launch_once_the_loads_are_issued(monkeypatch):
    """TVMFUSE_DEPENDENT_LAUNCH=late (an experiment): the wgmma GEMM still waits before its first load, and releases
    its successor after the loader's last TMA load, not right after the wait."""
    monkeypatch.setenv(SWITCH, "late")
    monkeypatch.setenv(WGMMA_SWITCH, "1")
    kernel = _gemm_source(256)
    wait, release = kernel.find("griddepcontrol_wait()"), kernel.find("griddepcontrol_launch_dependents()")
    assert 0 < wait < kernel.find("cp_async_bulk_tensor_g2s") < kernel.rfind("cp_async_bulk_tensor_g2s") < release
    assert kernel.count("griddepcontrol_launch_dependents()") == 1
    assert "griddepcontrol_launch_dependents()" in _gemm_source(16)  # other kernels: as with the switch at 1
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_gelu_projection(256, 512, 384), cuda, lambda _: None), cuda), cuda))
    assert len(_nvcc_fatbin(src, cuda)) > 1000  # ptxas takes it for sm_90a


def _wgmma_func() -> tvm.tirx.PrimFunc:
    """The wgmma GEMM of a 256-row projection, as built now (the switches as set)."""
    mod = apply_hopper_kernels(_gelu_projection(256, 512, 384), resolve_target("cuda"), lambda _: None)
    (gemm,) = [f for f in mod.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and f.attrs.get("tvmfuse.tirx") == "wgmma"]
    return gemm


def test_by_default_the_wgmma_gemm_launches_after_its_predecessor_and_still_releases(monkeypatch):
    """By default (TVMFUSE_WGMMA_DEPENDENT unset) the wgmma GEMM neither waits nor is launched dependent (the pass
    adds no wait at its top: it releases, so it has a griddepcontrol of its own); the small-M GEMM still waits.
    TVMFUSE_WGMMA_DEPENDENT=1 launches it dependent."""
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(WGMMA_SWITCH, "1")
    assert wgmma_waits() and any(TAG in params for params in _launch_params(_wgmma_func()).values())
    monkeypatch.delenv(WGMMA_SWITCH)
    assert not wgmma_waits() and dependent_launch()
    kernel = _gemm_source(256)
    assert "griddepcontrol_wait()" not in kernel
    assert 0 < kernel.find("griddepcontrol_launch_dependents()") < kernel.find("cp_async_bulk_tensor_g2s")
    assert all(TAG not in params for params in _launch_params(_wgmma_func()).values())
    assert "griddepcontrol_wait()" in _gemm_source(16)


@pytest.mark.parametrize("rows", [256, 16])
def test_the_switch_at_0_builds_kernels_that_neither_wait_nor_release(rows, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setenv(WGMMA_SWITCH, "1")
    assert "griddepcontrol_wait()" in _gemm_source(rows)  # on by default (the wgmma GEMM's: when asked)
    monkeypatch.setenv(SWITCH, "0")
    assert "griddepcontrol" not in _gemm_source(rows)


def test_it_applies_to_cuda_targets_of_sm_90_and_newer_unless_switched_off(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    cuda = {arch: tvm.target.Target({"kind": "cuda", "arch": arch}) for arch in ("sm_80", "sm_90", "sm_90a", "sm_100a")}
    assert [applies_to(t) for t in cuda.values()] == [False, True, True, True]
    assert not applies_to(tvm.target.Target("llvm")) and not applies_to(None)
    monkeypatch.setenv(SWITCH, "0")
    assert not applies_to(cuda["sm_90a"])


@pytest.mark.parametrize("before", [None, "0", "1", "late"])
def test_a_job_turns_the_switch_off_for_its_build_and_leaves_it_as_it_was(before, monkeypatch):
    if before is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, before)
    for off in (True, False):
        with dependent_launch_off(off):
            assert dependent_launch() is (not off and before != "0")
            assert release_late() is (not off and before == "late")  # a job keeps the late release it was given
        assert os.environ.get(SWITCH) == before
    with pytest.raises(RuntimeError), dependent_launch_off():
        raise RuntimeError("a failed build")
    assert os.environ.get(SWITCH) == before


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89"])
def test_before_sm_90_no_kernel_waits_or_is_launched_dependent(arch, monkeypatch):
    """griddepcontrol is sm_90's: an older arch gets neither the instructions nor the launch attribute, with the
    switch on (its default)."""
    monkeypatch.delenv(SWITCH, raising=False)
    assert _launch_params(_kernel(False), arch) == {"main_kernel": ["blockIdx.x", "threadIdx.x"]}
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    (src,) = cuda_sources(compile_module(apply_default_schedules(_gelu_projection(256, 512, 384), target), target))
    assert "griddepcontrol" not in src and "__global__" in src


def _chain(rows: int = 256, k: int = 512, seed: int = 0):
    """x -> four GEMMs in a row, each reading the one before (weights constants, fp16 out). Built with CUDA graphs,
    the middle two run in the graph (the first reads the input, the last writes the output), so one dependent launch
    is between two of the graph's kernels."""
    rng = np.random.default_rng(seed)
    ws = [(rng.standard_normal((k, k)) / np.sqrt(k)).astype("float16") for _ in range(4)]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, rows, k), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for w in ws:
                wt = bb.emit(relax.op.permute_dims(relax.const(w)))
                h = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(h, wt, out_dtype="float32")), "float16"))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return lower(bb.get()).mod, ws


def _build_chain(monkeypatch, cuda_graph: bool, rows: int = 256, ring: int = 0):
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(WGMMA_SWITCH, "1")
    monkeypatch.setenv(EARLY_WEIGHTS_SWITCH, "1")
    monkeypatch.setenv(RING_SWITCH, str(ring))
    cuda = resolve_target("cuda")
    mod, ws = _chain(rows)
    logged = []
    mod = apply_default_schedules(apply_hopper_kernels(mod, cuda, logged.append), cuda)
    kernel = "wgmma" if rows > 64 else "mma.sync small-M"
    assert len(logged) == 1 and f": {kernel} {rows}x512x512" in logged[0], logged  # one kernel, called four times
    assert "before the wait" in logged[0], logged  # constant weights: loaded (prefetched) before it
    assert ("the ring's first rounds copied before the wait" in logged[0]) == bool(ring), logged
    return compile_module(mod, cuda, cuda_graph=cuda_graph), ws


def test_the_chain_builds_four_waiting_gemms_two_of_them_in_a_cuda_graph(monkeypatch):
    ex, _ = _build_chain(monkeypatch, cuda_graph=True)
    text = ex.as_text()
    assert text.count("call  vm.builtin.cuda_graph.run_or_capture") == 1
    capture = text[text.index("@main_cuda_graph_capture:"):].split("\n@", 1)[0]  # the captured function
    assert capture.count("call  fused_relax_permute_dims_relax_matmul_relax_astype in") == 2, capture
    (src,) = cuda_sources(ex)
    assert src.count("griddepcontrol_wait();") == 2  # the loader's, after its early weights, and the consumers'


def _early_loads(kernel: str) -> tuple[list[str], list[str]]:
    """The loader thread's TMA loads before its dependency wait and those after it (which map each reads)."""
    loader = kernel[kernel.index("if (((int)threadIdx.x) == 0) {", kernel.index("if (((int)threadIdx.x) < 128) {")):]
    before, after = loader.split("griddepcontrol_wait();", 1)
    loads = "cp_async_bulk_tensor_g2s_cluster_async_bulk_tensor_2d_shared__cluster_global_mbarrier__complete_tx__bytes("
    maps = lambda text: [part.split("&(", 2)[2][:5] for part in text.split(loads)[1:]]  # noqa: E731
    return maps(before), maps(after.split("griddepcontrol_wait();", 1)[0])  # (up to the consumers' wait)


def test_a_gemm_of_a_weight_loads_its_first_weight_tiles_before_the_wait_and_the_rest_after(monkeypatch):
    """With TVMFUSE_EARLY_WEIGHTS=1, the chain's GEMMs (constant weights): the loader issues B's loads of the first
    `stages` k-tiles before it waits for the kernel before (they read nothing that kernel writes), then A's and every
    later load after it; the consumers wait before their mainloop; the small-M kernel prefetches its weight rows into
    L2 before its wait. Off (the default), and for a GEMM whose weight is an input of main, nothing loads before the
    wait."""
    cuda = resolve_target("cuda")

    def kernel(mod):
        logged = []
        (src,) = cuda_sources(compile_module(apply_default_schedules(apply_hopper_kernels(mod, cuda, logged.append),
                                                                     cuda), cuda))
        return src.split("__global__")[-1], logged

    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv(WGMMA_SWITCH, "1")  # the wgmma GEMM loads early only where it waits
    monkeypatch.setenv(EARLY_WEIGHTS_SWITCH, "1")
    src, logged = kernel(_chain(k=1024)[0])  # 16 k-tiles: more than the ring's stages
    assert "weights loaded before the wait" in logged[0], logged
    before, after = _early_loads(src)
    stages = src.count("tvm_builtin_ptx_mbarrier_init_init_shared_b64(") // 2
    assert before == ["b_map"] * stages and "a_map" in after and "b_map" in after, (before, after)
    consumers = src[src.index("} else {", src.index("if (((int)threadIdx.x) < 128) {")):]
    assert consumers.index("griddepcontrol_wait();") < consumers.index("wgmma")
    assert len(_nvcc_fatbin(cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_chain()[0], cuda, lambda _: None), cuda), cuda))[0], cuda)) > 1000
    monkeypatch.delenv(EARLY_WEIGHTS_SWITCH)  # the default
    for rows in (256, 16):
        src, logged = kernel(_chain(rows=rows)[0])
        assert "before the wait" not in logged[0] and src.count("griddepcontrol_wait();") == 1
        assert "prefetch_l2" not in src
    assert src.index("griddepcontrol_wait();") < src.index("ld_stream((&(")
    monkeypatch.setenv(EARLY_WEIGHTS_SWITCH, "1")
    src, logged = kernel(_gelu_projection(256, 512, 384))  # its weight is main's parameter: maybe written before
    assert "weights loaded before" not in logged[0] and src.count("griddepcontrol_wait();") == 1
    src, logged = kernel(_chain(rows=16, k=1024)[0])  # small M: the weights into L2 before the wait
    assert "weights prefetched before the wait" in logged[0], logged
    prefetch, wait = src.index("tvmfuse_prefetch_l2_bulk((&("), src.index("griddepcontrol_wait();")
    assert 0 < prefetch < wait < src.index("ld_stream((&(")
    assert len(_nvcc_fatbin(cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_chain(rows=16, k=1024)[0], cuda, lambda _: None), cuda), cuda))[0], cuda)) > 1000
    monkeypatch.setenv(RING_SWITCH, "4")  # with a weight ring: its first rounds are copied before the wait too
    src, logged = kernel(_chain(rows=16, k=1024)[0])
    assert "the ring's first rounds copied before the wait" in logged[0], logged
    wait = src.index("griddepcontrol_wait();")
    stages = int(logged[0].split("a weight ring of ")[1].split()[0])
    assert src[:wait].count("tvmfuse_cp_async_commit()") == stages - 1, src[:wait]  # one group a round
    assert src[:wait].count("tvmfuse_cp_async16(") > 0 and src.index("tvmfuse_prefetch_l2_bulk((&(") < wait
    assert "tvmfuse_lds16(" not in src[:wait]
    assert len(_nvcc_fatbin(cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_chain(rows=16, k=1024)[0], cuda, lambda _: None), cuda), cuda))[0], cuda)) > 1000
    monkeypatch.delenv(RING_SWITCH)
    monkeypatch.setenv(SWITCH, "0")  # no dependent launch: nothing to load early for
    assert not early_weights()
    for rows in (256, 16):
        src, logged = kernel(_chain(rows=rows)[0])
        assert "before the wait" not in logged[0] and "griddepcontrol" not in src and "prefetch_l2" not in src


def test_ptxas_keeps_the_early_ring_copies_before_the_dependency_wait(monkeypatch):
    """ptxas hoists the wait (`ACQBULK`) above plain `ld.global` loads written before it (docs/kernels.md), so the
    early ring is checked in the SASS: every asynchronous copy (`LDGSTS`) of the ring's first stages - 1 rounds and
    their commits (`LDGDEPBAR`) lie before it, the L2 prefetch (`UBLKPF`) too, and the rest after it."""
    from bench.attention_sass import parse_sass  # pylint: disable=import-outside-toplevel
    from bench.sass_mix import sass_of, tool  # pylint: disable=import-outside-toplevel
    try:
        tool("nvcc"), tool("cuobjdump"), tool("nvdisasm")
    except SystemExit as e:
        pytest.skip(str(e))
    cuda = resolve_target("cuda")
    for name, value in ((SWITCH, "1"), (EARLY_WEIGHTS_SWITCH, "1"), (RING_SWITCH, "4")):
        monkeypatch.setenv(name, value)
    logged = []
    (src,) = cuda_sources(compile_module(apply_default_schedules(
        apply_hopper_kernels(_chain(rows=16, k=4096)[0], cuda, logged.append), cuda), cuda))
    stages = int(logged[0].split("a weight ring of ")[1].split()[0])
    (ops,) = [[op for _, _, op, _ in ins] for ins in parse_sass(sass_of(src)).values()]
    wait = ops.index("ACQBULK")
    before, after = ops[:wait], ops[wait:]
    copies = [op for op in before if op.startswith("LDGSTS")]
    assert before.count("LDGDEPBAR") == stages - 1 and len(copies) >= stages - 1, before
    assert any(op.startswith("UBLKPF") for op in before) and any(op.startswith("LDGSTS") for op in after)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ring", [(256, 0), (16, 0), (16, 4)])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_dependent_kernels_in_a_cuda_graph_match_numpy_on_the_gpu(monkeypatch, cuda_graph, rows, ring):
    """Each GEMM reads what the one before wrote: a kernel that read before its predecessor finished would read
    stale values (the output buffers are reused across the 20 calls with new inputs each time). The weights are
    loaded (wgmma) or prefetched (small M; with a ring, its first rounds also copied) before each kernel's wait."""
    ex, ws = _build_chain(monkeypatch, cuda_graph, rows, ring)
    vm = relax.VirtualMachine(ex, tvm.cuda(0))
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.standard_normal((1, rows, 512)).astype("float16")
        got = vm["main"](tvm.runtime.tensor(x, tvm.cuda(0))).numpy().astype("float32")
        want = x
        for w in ws:
            want = (want.astype("float32") @ w.astype("float32").T).astype("float16")
        np.testing.assert_allclose(got, want.astype("float32"), atol=3e-2, rtol=3e-2)
