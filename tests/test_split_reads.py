"""tvmfuse.kernels.split_reads: attention kernels read Q, K and V where a one-kernel split would cut them from one
tensor (the packed template variants), so the split is not launched; and the packed variants themselves."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from checks import check_against_ort, lower_model
from test_legalize import _split_attention
from tvm import relax

from tvmfuse.kernels import ATTENTION_PREFILL, ATTENTION_PREFILL_WGMMA, substitute
from tvmfuse.kernels.attention.common import normalize
from tvmfuse.kernels.attention.prefill_wgmma_kernel import tma_map
from tvmfuse.kernels.split_reads import read_split_parts


def _kernels_called(mod: tvm.IRModule) -> list[str]:
    """The PrimFuncs `main` calls, in order."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            found.append(expr.args[0].name_hint)
    relax.analysis.post_order_visit(mod["main"], visit)
    return found


@pytest.mark.parametrize("seq,dyn,template", [(8, False, "attention_decode"), (64, False, "attention_prefill"),
                                              (8, True, "attention_step")])
def test_attention_reads_qkv_where_the_split_would_cut_it(seq, dyn, template, llvm):
    """GPT-2's shape of attention input (one [B, S, 3 H D] tensor split in three, each part reshaped to heads): after
    substitution the template's kernel takes the split's input itself, under its own name, and `main` launches it
    alone: no split, no reshape. Equal to onnxruntime, symbolic batch and sequence too."""
    model = _split_attention(s=seq, dyn=dyn)
    imp, fused = lower_model(model)
    log = []
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    (name,) = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert _kernels_called(mod).count("split") == 1 and log == [(name, f"template {template}")]
    fused.mod = read_split_parts(mod, "llvm", log=log)
    assert _kernels_called(fused.mod) == [name], fused.mod["main"]
    assert "split" not in {gv.name_hint for gv in fused.mod.functions}  # dead, gone
    assert log[1][0] == name and "read in place from the split's input (rows of 192, at 0, 64, 128)" in log[1][1]
    fn = fused.mod[name]
    assert [int(p.ty.shape[-1]) for p in fn.params] == [192, 16]  # one qkv parameter, then out
    result = check_against_ort(model, imp, fused, llvm)
    assert result.ok and result.max_abs_err < 1e-5, result


@pytest.mark.parametrize("leak", ["k", "k+1"])
def test_a_part_read_elsewhere_keeps_the_split(leak, llvm):
    """K also a model output, or read by an add: the split must run for it, so the attention reads the parts as
    before (no packed variant, no log line) and the result stays onnxruntime's."""
    model = _split_attention(leak, s=64)
    imp, fused = lower_model(model)
    log = []
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    fused.mod = read_split_parts(mod, "llvm", log=log)
    assert fused.mod is mod and len(log) == 1
    assert _kernels_called(mod).count("split") == 1
    result = check_against_ort(model, imp, fused, llvm)
    assert result.ok and result.max_abs_err < 1e-5, result


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_gpt2_export_reads_its_qkv_in_place_and_matches_onnxruntime(exporter, hf_exports, llvm):
    """A tiny GPT-2 export in fp16 at batch 2, seq 64, prepared as the pipeline prepares it (its c_attn output split
    in three): both layers' attention read Q, K and V from c_attn's output, with the padding mask; no split launched;
    within fp16's tolerance of onnxruntime, left padding included. (Dynamo's K^T, through a reshape to K's own shape,
    is inside the attention once the prepare stage drops that reshape.)"""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    import onnxruntime as ort
    from tvmfuse.build.compile import build
    from tvmfuse.decide.decision import decide
    from tvmfuse.frontend.importer import import_model, load_onnx
    from tvmfuse.fuse.fusion import lower
    from tvmfuse.prepare import prepare_module

    model = load_onnx(hf_exports("gpt2", exporter))
    imp = import_model(model, {"batch": [2], "seq": [64]})
    bound = prepare_module(imp, "fp16")
    fused = lower(bound, plan=decide(bound))
    log = []
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert _kernels_called(mod).count("split") == 2, _kernels_called(mod)
    mod = read_split_parts(mod, "llvm", log=log)
    called = _kernels_called(mod)
    assert "split" not in called and sum("no split launched" in o for _, o in log) == 1, log
    attention = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert sorted(called.count(k) for k in attention) == [2], called  # one kernel, both layers
    vm = relax.VirtualMachine(build(mod, llvm)[0], tvm.cpu())
    sess = ort.InferenceSession(model.SerializeToString())
    ids = np.random.default_rng(0).integers(0, 128, (2, 64)).astype("int64")
    am = np.stack([(np.arange(64) >= pad) for pad in (0, 5)]).astype("int64")
    got = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(am)).numpy()
    want = sess.run(None, {"input_ids": ids, "attention_mask": am})[0]
    tol = 1e-2
    assert np.all(np.abs(got - want) <= tol + tol * np.abs(want)), np.abs(got - want).max()


def _two_attentions():
    """Two of `_split_attention`'s blocks over inputs qkv and qkv2 (one kernel for both), the second's K part also a
    model output."""
    import onnx

    one, two = _split_attention(s=64), _split_attention("k", s=64)
    rename = lambda n: n if n in ("parts", "heads", "scale") else f"{n}_2"  # noqa: E731
    graph = one.graph
    for node in two.graph.node:
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
        graph.node.append(node)
    for value in (*two.graph.input, *two.graph.output):
        value.name = rename(value.name)
    graph.input.extend(two.graph.input)
    graph.output.extend(two.graph.output)
    onnx.checker.check_model(one)
    return one


def test_a_kernel_packed_at_one_call_and_not_at_another_gets_a_packed_copy(llvm):
    """The two blocks' attention is one kernel; the first reads its split's input in place, the second (whose K is an
    output too) keeps its split: the first calls `<kernel>_packed`, the second the kernel itself; both right."""
    model = _two_attentions()
    imp, fused = lower_model(model)
    (name,) = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    log = []
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert _kernels_called(mod).count(name) == 2
    fused.mod = read_split_parts(mod, "llvm", log=log)
    called = _kernels_called(fused.mod)
    assert called.count(name) == 1 and called.count(f"{name}_packed") == 1 and called.count("split") == 1, called
    assert log[-1][0] == f"{name}_packed"
    result = check_against_ort(model, imp, fused, llvm)
    assert result.ok and result.max_abs_err < 1e-5, result


def test_a_template_that_refuses_the_packed_shapes_keeps_the_split(monkeypatch, llvm):
    """Where the template raises for the packed shapes, the call keeps its parts and the split, with a log line."""
    import dataclasses

    from tvmfuse.kernels import split_reads

    def refusing(build):
        def build_fn(s, knobs, target):
            if s.get("packed"):
                raise ValueError("no packed variant here")
            return build(s, knobs, target)
        return build_fn

    table = {k: dataclasses.replace(e, templates=tuple(dataclasses.replace(t, build_fn=refusing(t.build_fn))
                                                       for t in e.templates)) for k, e in split_reads.TABLE.items()}
    monkeypatch.setattr(split_reads, "TABLE", table)
    model = _split_attention(s=64)
    imp, fused = lower_model(model)
    log = []
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    fused.mod = read_split_parts(mod, "llvm", log=log)
    assert fused.mod is mod and "Q, K and V stay split (ValueError: " in log[-1][1] and "no packed variant" in log[-1][1]
    result = check_against_ort(model, imp, fused, llvm)
    assert result.ok and result.max_abs_err < 1e-5, result


def test_switched_off_every_split_is_launched(monkeypatch, llvm):
    """`bench/models.py --before split_reads`: the before build keeps the split (the module comes back as it was);
    after it the switch is back and the attention reads the split's input."""
    import os
    import sys

    from tvmfuse.kernels.split_reads import SWITCH

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.model_builds import SPLIT_READS, without_templates  # pylint: disable=import-outside-toplevel

    monkeypatch.delenv(SWITCH, raising=False)
    _, fused = lower_model(_split_attention(s=64))
    mod = substitute(fused.mod, fused.kernel_patterns, target="llvm")
    with without_templates((SPLIT_READS,)):
        assert read_split_parts(mod, "llvm") is mod
    assert SWITCH not in os.environ and "split" not in _kernels_called(read_split_parts(mod, "llvm"))


PACKED = dict(batch=2, heads=4, kv_heads=4, seq_q=128, seq_k=128, head_dim=64, dtype="float16", q_layout="BSHD",
              k_layout="BSHD", v_layout="BSHD", out_layout="BSHD", packed=(768, 0, 256, 512))


@pytest.mark.parametrize("change,message", [
    (dict(packed=(768, 0, 200, 512)), "must lie apart"),  # K overlaps V
    (dict(packed=(700, 0, 256, 512)), "must lie apart"),  # V past the row's end
    (dict(q_layout="BHSD"), "BSHD, one sequence length"),
    (dict(seq_k=256), "BSHD, one sequence length"),
    (dict(packed=(768, 0, 256)), "(row width, Q offset, K offset, V offset)"),
    (dict(packed=(772, 4, 260, 516)), "multiples of 8 elements"),  # 16-byte loads off their alignment
])
def test_packed_shapes_are_checked(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        normalize(dict(PACKED, **change))


def test_packing_leaves_the_records_key_alone():
    """The packed kernel and the one that reads three tensors differ in their row stride alone: the tuning records'
    key is one, so knobs measured apart apply."""
    apart = {k: v for k, v in PACKED.items() if k != "packed"}
    assert ATTENTION_PREFILL.key(PACKED) == ATTENTION_PREFILL.key(apart)


def test_the_packed_tensor_map_steps_a_row_per_position():
    """BSHD in a [B, S, 768] tensor: heads 64 elements apart, positions 768, batches 768 x S (bytes, fp16)."""
    dims_strides = tma_map("BSHD", 2, 4, 128, 64, 128, row=768)[0][:7]
    assert dims_strides == [64, 4, 128, 2, 128, 1536, 1536 * 128]
    assert tma_map("BSHD", 2, 4, 128, 64, 128)[0][4:7] == [128, 512, 512 * 128]
    with pytest.raises(ValueError, match="packed BSHD layout only"):
        tma_map("BHSD", 2, 4, 128, 64, 128, row=768)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_packed_variants_compile_with_one_qkv_parameter():
    """The wgmma (sm_90a) and mma.sync variants of a packed shape compile for CUDA; each takes (qkv, out)."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target

    for tmpl, extra, pipeline in ((ATTENTION_PREFILL_WGMMA, {"arch": "sm_90a"}, "tirx"), (ATTENTION_PREFILL, {}, None)):
        fn = tmpl(dict(PACKED, **extra))
        assert [tuple(int(x) for x in p.ty.shape) for p in fn.params] == [(2, 128, 768), (2, 128, 4, 64)]
        kwargs = {"tir_pipeline": pipeline} if pipeline else {}
        ex = tvm.compile(tvm.IRModule({"main": fn}), target=hopper_target(), **kwargs)
        assert "__global__" in ex.mod.imports[0].inspect_source()


def _attention_ref(q, k, v):
    s = q.astype("f4") @ k.astype("f4").transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype("f4")


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("which", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("offsets", [(0, 256, 512), (512, 0, 256)])
def test_gpu_packed_prefill_matches_numpy(which, offsets):
    """On the GPU: the packed variants read Q, K and V at their offsets in each row of one [B, S, 768] tensor (in
    the split's order, and another) and match numpy within fp16's tolerance."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target

    s = dict(PACKED, packed=(768, *offsets), arch="sm_90a")
    tmpl = ATTENTION_PREFILL_WGMMA if which == "wgmma" else ATTENTION_PREFILL
    fn = tmpl(s)
    lib = tvm.compile(tvm.IRModule({"main": fn}), target=hopper_target(),
                      **({"tir_pipeline": "tirx"} if which == "wgmma" else {}))
    rng, dev = np.random.default_rng(0), tvm.cuda(0)
    qkv = rng.standard_normal((2, 128, 768)).astype("float16")
    q, k, v = (qkv[:, :, o:o + 256].reshape(2, 128, 4, 64).transpose(0, 2, 1, 3) for o in offsets)
    want = _attention_ref(q, k, v).transpose(0, 2, 1, 3)
    out = tvm.runtime.tensor(np.full((2, 128, 4, 64), np.nan, "float16"), dev)
    lib["main"](tvm.runtime.tensor(qkv, dev), out)
    assert np.abs(out.numpy().astype("f4") - want).max() < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_gpt2_job_launches_no_split_and_verifies(hf_exports, tmp_path):
    """The product path on the GPU: a tiny GPT-2 export at batch 2, seq 128, fp16: the job logs the attention reading
    Q, K and V in place and verifies against onnxruntime."""
    from tvmfuse.jobs import Job
    from tvmfuse.pipeline import run_job
    from tvmfuse.targets import resolve_target

    said = []
    job = Job("gpt2", hf_exports("gpt2"), trials=0, dtype="fp16", shapes={"batch": [2], "seq": [128]})
    result = run_job(job, resolve_target("cuda"), str(tmp_path / "out"), str(tmp_path / "logs"), say=said.append,
                     schedules=None)
    assert result.ok and result.verification.startswith("ok"), (result.error, result.verification, said[-20:])
    assert any("no split launched" in line for line in said), said

