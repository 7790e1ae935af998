"""Fault isolation: a failure injected at each per-kernel step (design space, search, replay, default schedule,
template, Hopper kernel) leaves the job exporting and verifying, the kernel on its default schedule, one warning
line naming it, and the manifest's `failures` entry (kernel, step, reason)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper

import tvmfuse.build.compile as build_mod
import tvmfuse.spaces.defaults as defaults_mod
import tvmfuse.kernels.hopper.select as hopper_mod
import tvmfuse.kernels.substitution as kernels_mod
import tvmfuse.tune.search as tune_mod
import tvmfuse.tune.isolation as tune_isolation
from tvmfuse import isolation
from tvmfuse.cli.tune import main
from tvmfuse.decide import decide
from tvmfuse.fuse import lower
from tvmfuse.frontend import import_model
from tvmfuse.prepare import prepare_module
from tvmfuse.tune import tunable_tasks


def _mlp(path: str) -> str:
    """LayerNorm -> MatMul -> Relu -> MatMul -> Softmax on [16, 64]: a few kernels of different kinds."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 64)).astype("float32") * 0.1
    w2 = rng.standard_normal((64, 32)).astype("float32") * 0.1
    inits = [helper.make_tensor("w1", TensorProto.FLOAT, w1.shape, w1.flatten()),
             helper.make_tensor("w2", TensorProto.FLOAT, w2.shape, w2.flatten()),
             helper.make_tensor("g", TensorProto.FLOAT, [64], np.ones(64, "float32")),
             helper.make_tensor("b", TensorProto.FLOAT, [64], np.zeros(64, "float32"))]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1),
             helper.make_node("MatMul", ["ln", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["o"]), helper.make_node("Softmax", ["o"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10), path)
    return path


def _kernels(path, llvm) -> list[str]:
    imp = import_model(onnx.load(path))
    bound = prepare_module(imp)
    return sorted(t.task_name for t in tunable_tasks(lower(bound, plan=decide(bound, llvm)).mod, llvm))


def test_a_failure_at_each_step_keeps_the_job(tmp_path, llvm, monkeypatch, capsys):
    path = _mlp(str(tmp_path / "mlp.onnx"))
    names = _kernels(path, llvm)
    assert len(names) >= 3, names
    space_k, search_k, replay_k = names[:3]
    real_space, real_group, real_replay = tune_isolation.generate_space, tune_mod._tune_group, build_mod.replay_record

    def space(ctx):
        if ctx.task_name == space_k:
            raise RuntimeError("injected space failure")
        return real_space(ctx)

    def group(contexts, *args):
        if any(c.task_name == search_k for c in contexts):
            raise RuntimeError("injected search failure")
        return real_group(contexts, *args)

    def replay(gv, func, *args):
        if gv.name_hint == replay_k:
            raise RuntimeError("injected replay failure")
        return real_replay(gv, func, *args)

    monkeypatch.setattr(tune_isolation, "generate_space", space)
    monkeypatch.setattr(tune_mod, "_tune_group", group)
    monkeypatch.setattr(build_mod, "replay_record", replay)
    code = main([path, "--target", "llvm", "--trials", "2", "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), "--schedules", "none"])
    text = capsys.readouterr()
    assert code == 0, text.err[-2000:]
    with open(os.path.join(tmp_path, "o", "mlp-llvm", "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    got = {(f["kernel"], f["step"]) for f in manifest["failures"]}
    assert {(space_k, isolation.SPACE), (search_k, isolation.SEARCH), (replay_k, isolation.REPLAY)} <= got
    reasons = {(f["kernel"], f["step"]): f["reason"] for f in manifest["failures"]}
    assert "injected space failure" in reasons[(space_k, isolation.SPACE)]
    assert "injected search failure" in reasons[(search_k, isolation.SEARCH)]
    assert "injected replay failure" in reasons[(replay_k, isolation.REPLAY)]
    assert manifest["verification"]["status"] == "passed"
    import onnxruntime as ort  # the export itself, against onnxruntime
    from tvmfuse.export.runtime import load

    x = np.random.default_rng(1).standard_normal((16, 64)).astype("float32")
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(load(str(tmp_path / "o" / "mlp-llvm"))(x)[0], ref, atol=1e-5, rtol=1e-4)
    kinds = {k["name"]: k["schedule"] for k in manifest["kernels"]}
    assert kinds[space_k] != "tuned" and kinds[replay_k] != "tuned"
    others = [n for n in names if n not in (space_k, search_k, replay_k)]
    assert all(kinds[n] == "tuned" for n in others if n in kinds)  # the siblings went on
    warnings = [ln for ln in (text.out + text.err).splitlines() if "warning: kernel" in ln]
    for kernel, step in ((space_k, isolation.SPACE), (search_k, isolation.SEARCH), (replay_k, isolation.REPLAY)):
        assert sum(f"kernel {kernel}: {step} failed" in ln for ln in warnings) == 1


def test_default_schedule_failure_keeps_the_kernel_unscheduled_on_cpu(tmp_path, llvm, monkeypatch):
    path = _mlp(str(tmp_path / "mlp.onnx"))
    imp = import_model(onnx.load(path))
    fused = lower(prepare_module(imp), plan=None, target=llvm)
    first = fused.kernels()[0]
    real = defaults_mod.default_rule
    target_func = fused.mod[first]
    monkeypatch.setattr(defaults_mod, "default_rule", lambda f, *a: (_ for _ in ()).throw(RuntimeError("boom"))
                        if f.same_as(target_func) else real(f, *a))
    with isolation.collecting(lambda s: None) as failures:
        out = defaults_mod.apply_default_schedules(fused.mod, llvm)
    assert failures.items == [{"kernel": first, "step": isolation.DEFAULT_SCHEDULE, "reason": "RuntimeError: boom"}]
    assert out[first].same_as(target_func)  # kept as it was
    build_mod.compile_module(out, llvm)  # and the module still builds


def test_template_failure_keeps_the_generic_kernel(tmp_path, llvm, monkeypatch):
    path = _mlp(str(tmp_path / "mlp.onnx"))
    fused = lower(prepare_module(import_model(onnx.load(path))), target=llvm)
    gv = fused.mod.get_global_var(fused.kernels()[0])

    class Broken:
        name = "broken"

        def __call__(self, *_):
            raise ValueError("template cannot take it")

    monkeypatch.setattr(kernels_mod, "template_sites", lambda *a, **k: [(gv, gv.name_hint, Broken(), {}, [0])])
    log: list = []
    with isolation.collecting(lambda s: None) as failures:
        out = kernels_mod.substitute(fused.mod, fused.kernel_patterns, target="cuda", log=log)
    assert out.same_as(fused.mod)
    assert failures.items[0]["kernel"] == gv.name_hint and failures.items[0]["step"] == isolation.TEMPLATE
    assert "template cannot take it" in failures.items[0]["reason"]


def test_hopper_kernel_failure_keeps_the_generic_kernel(tmp_path, llvm, monkeypatch):
    path = _mlp(str(tmp_path / "mlp.onnx"))
    fused = lower(prepare_module(import_model(onnx.load(path))), target=llvm)

    def broken(func, name, tile=None, weights=frozenset()):
        raise IndexError("injected hopper failure")

    monkeypatch.setattr(hopper_mod, "gemm_kernel_from_fused", broken)
    monkeypatch.setattr(hopper_mod, "row_kernel_from_fused", lambda func, name: (None, "not a row"))
    with isolation.collecting(lambda s: None) as failures:
        out = hopper_mod.apply_hopper_kernels(fused.mod, tvm.target.Target("nvidia/nvidia-h100"), lambda s: None)
    assert out.same_as(fused.mod)
    assert {f["step"] for f in failures.items} == {isolation.HOPPER}
    assert {f["kernel"] for f in failures.items} >= set(fused.kernels())
    assert all("injected hopper failure" in f["reason"] for f in failures.items)
