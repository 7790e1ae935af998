"""tvmfuse.prepare.siblings: sibling projections of one input become one matmul and a split where the rule says it
pays; the numbers stay onnxruntime's, and a weight read elsewhere, another width or a symbolic row count blocks it."""

import re

import numpy as np
import onnx_models
import pytest
import tvm
from checks import check_against_ort
from tvm import relax

from tvmfuse.frontend import import_model
from tvmfuse.fuse.fusion import lower
from tvmfuse.kernels.hopper.select import MERGE_SWITCH, sibling_merge_pays
from tvmfuse.prepare import prepare_module
from tvmfuse.targets import resolve_target

ALWAYS = lambda m, n, k, count: True  # noqa: E731


def _ops(mod: tvm.IRModule, name: str) -> list:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == f"relax.{name}":
            found.append(e)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return found


@pytest.mark.parametrize("bias", [True, False])
def test_siblings_become_one_matmul_and_a_split_with_onnxruntimes_numbers(bias):
    model = onnx_models.sibling_projections(bias=bias)
    imp = import_model(model)
    merged = []
    bound = prepare_module(imp, merge_pays=ALWAYS, merged=merged)
    assert merged == [(128, 64, 64, 3)]
    (matmul,) = _ops(bound, "matmul")
    assert [int(d) for d in matmul.args[1].ty.shape.values] == [64, 192]  # [K, 3N] (a permute of the stored W^T)
    assert len(_ops(bound, "split")) == 1 and len(_ops(bound, "add")) == (2 if bias else 1)
    fused = lower(bound)
    check = check_against_ort(model, imp, fused, resolve_target("llvm"))
    assert check.ok and check.max_abs_err < 1e-4, check


def test_a_weight_read_elsewhere_keeps_its_matmul_and_the_other_two_merge():
    imp = import_model(onnx_models.sibling_projections(tied=True))
    merged = []
    bound = prepare_module(imp, merge_pays=ALWAYS, merged=merged)
    assert merged == [(128, 64, 64, 2)]  # Q and V; K's weight is also x2's
    assert len(_ops(bound, "matmul")) == 3 and len(_ops(bound, "split")) == 1


@pytest.mark.parametrize("case", ["widths", "rule", "none", "symbolic"])
def test_other_widths_a_rule_that_says_no_or_symbolic_rows_merge_nothing(case):
    model = onnx_models.sibling_projections(widths=(64, 32, 16) if case == "widths" else None)
    imp = import_model(_symbolic_rows(model) if case == "symbolic" else model)
    merged = []
    pays = {"rule": lambda *a: False, "none": None}.get(case, ALWAYS)
    bound = prepare_module(imp, merge_pays=pays, merged=merged)
    assert merged == [] and len(_ops(bound, "matmul")) == 3 and _ops(bound, "split") == []


def _symbolic_rows(model):
    """The model with its row count a named dim (`rows`)."""
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "rows"
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "rows"
    return model


@pytest.mark.parametrize("sizes,pays,want", [([{"rows": 128}, {"rows": 512}], ALWAYS, [("128..512", 64, 64, 3)]),
                                             ([{"rows": 512}], ALWAYS, [(512, 64, 64, 3)]),
                                             ([{"rows": 128}, {"rows": 512}], lambda m, *_: m > 200, []),
                                             ([{"other": 512}], ALWAYS, [])])
def test_symbolic_rows_merge_where_the_rule_pays_at_every_bucket(sizes, pays, want):
    """A dynamic export (rows a named dim) is judged at the build's bucket sizes: merged where the rule pays at
    each (the numbers stay onnxruntime's at any row count), not where it fails at one or no size names the dim."""
    model = _symbolic_rows(onnx_models.sibling_projections())
    imp = import_model(model)
    merged = []
    bound = prepare_module(imp, merge_pays=pays, merged=merged, merge_sizes=sizes)
    assert merged == want
    assert len(_ops(bound, "matmul")) == (1 if want else 3) and len(_ops(bound, "split")) == (1 if want else 0)
    if want:
        check = check_against_ort(model, imp, lower(bound), resolve_target("llvm"))
        assert check.ok and check.max_abs_err < 1e-4, check


@pytest.mark.parametrize("buckets,merges", [("rows=512", True), ("rows=16,512", False)])
def test_a_cuda_build_of_a_dynamic_export_merges_at_its_buckets(buckets, merges, tmp_path, capsys):
    """The product path on sm_90a without a GPU, rows symbolic: with --buckets rows=512 the log names the merged
    group at 512 rows and the bucket's GEMM is the merged wgmma one; with a decode-sized bucket too (16 rows, where
    the rule says the small-M kernel gains nothing from the merge) nothing merges."""
    import onnx

    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it)")
    onnx.save(_symbolic_rows(onnx_models.sibling_projections(rows=512, k=256, n=256)), tmp_path / "qkv.onnx")
    code = main(["--target", "cuda", "--trials", "0", "--dtype", "fp16", "--buckets", buckets,
                 "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"), str(tmp_path / "qkv.onnx")])
    assert code == 0
    out = capsys.readouterr().out
    if merges:
        assert "sibling projections: 1 group(s) of 3 x 512x256x256 GEMMs" in out, out
        assert re.search(r"main_rows512: \S+: wgmma 512x768x256,", out), out
    else:
        assert "sibling projections" not in out and re.search(r"main_rows512: \S+: wgmma 512x256x256,", out), out


def test_the_hopper_rule_merges_where_its_estimate_beats_the_siblings():
    """One GEMM of 3N pays where each sibling leaves SMs idle for a short k-loop (BERT-base's 768-wide Q, K, V at
    512 rows: 96 64x64 tiles each, merged 72 128x128 tiles in one wave; at 2048 rows 96 128x128 tiles each, merged
    132 192x192 tiles, one full wave: 21.0 µs measured against 3 x 10.4, wgmma_run13_gpt2.json, with the split's
    copy of 9.4 MB estimated at 6.7); not where each already fills its waves (Llama-2-7B's 4096-wide ones), and not
    at decode's rows, which the GEMV and small-M kernels take."""
    assert sibling_merge_pays(512, 768, 768, 3)
    assert sibling_merge_pays(2048, 768, 768, 3)
    assert not sibling_merge_pays(512, 4096, 4096, 3) and not sibling_merge_pays(2048, 4096, 4096, 3)
    assert not sibling_merge_pays(16, 768, 768, 3) and not sibling_merge_pays(1, 768, 768, 3)


def test_the_merge_switch_merges_every_group_the_wgmma_kernel_takes(monkeypatch):
    """TVMFUSE_MERGE_SIBLINGS=1 (off by default, for `bench/models.py --before merge_siblings`): Llama-2-7B's Q, K, V
    at 512 and 2048 rows merge too, and at decode rows (the GEMV and small-M kernels); any other value leaves the
    estimate to decide."""
    monkeypatch.setenv(MERGE_SWITCH, "1")
    assert sibling_merge_pays(512, 4096, 4096, 3) and sibling_merge_pays(2048, 11008, 4096, 2)
    assert sibling_merge_pays(16, 4096, 4096, 3) and sibling_merge_pays(1, 4096, 4096, 3)
    monkeypatch.setenv(MERGE_SWITCH, "0")
    assert not sibling_merge_pays(512, 4096, 4096, 3) and sibling_merge_pays(512, 768, 768, 3)
    assert not sibling_merge_pays(16, 4096, 4096, 3)


def test_a_cuda_build_merges_the_siblings_into_one_wgmma_gemm_and_a_split(tmp_path, capsys):
    """The product path on sm_90a without a GPU (`--target cuda --trials 0`): the log names the merged group, the
    merged GEMM is the wgmma kernel and the only GEMM, and the split is fused into the kernel of the elementwise
    work that reads its parts (BERT's parts feed the attention: there it is one kernel of its own)."""
    import json

    import onnx

    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it)")
    onnx.save(onnx_models.sibling_projections(rows=512, k=256, n=256), tmp_path / "qkv.onnx")
    code = main(["--target", "cuda", "--trials", "0", "--dtype", "fp16", "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), str(tmp_path / "qkv.onnx")])
    assert code == 0
    out = capsys.readouterr().out
    assert "sibling projections: 1 group(s) of 3 x 512x256x256 GEMMs" in out, out
    assert "wgmma 512x768x256" in out, out
    kernels = json.loads((tmp_path / "o" / "qkv-cuda-sm_90a" / "manifest.json").read_text())["kernels"]
    gemms = [k for k in kernels if k["pattern"].startswith("tvmfuse.matmul")]
    assert len(gemms) == 1 and gemms[0]["schedule"] == "wgmma (TIRx kernel)", kernels
    assert len([k for k in kernels if k["name"].startswith("fused_split")]) == 1, kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_cuda_build_with_merged_siblings_verifies_against_onnxruntime(dtype, tmp_path, capsys):
    """On the GPU the same job merges, verifies against onnxruntime at the dtype's tolerance and exports; the
    export's outputs match onnxruntime's."""
    import onnx
    import onnxruntime as ort

    import tvmfuse
    from tvmfuse.cli.tune import main

    model = onnx_models.sibling_projections(rows=512, k=256, n=256)
    onnx.save(model, tmp_path / "qkv.onnx")
    code = main(["--target", "cuda", "--trials", "0", "--dtype", dtype, "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), str(tmp_path / "qkv.onnx")])
    out = capsys.readouterr().out
    assert code == 0 and "sibling projections: 1 group(s)" in out, out
    x = np.random.default_rng(0).standard_normal((1, 512, 256)).astype("float32")
    (got,) = tvmfuse.load(str(tmp_path / "o" / "qkv-cuda-sm_90a"))(x=x)
    (want,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    tol = 2e-2 if dtype == "fp16" else 8e-2
    np.testing.assert_allclose(got.astype("float32"), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_a_gqa_decoders_k_and_v_merge_and_it_keeps_onnxruntimes_numbers(exporter, tmp_path):
    """A tiny Llama with grouped-query attention (Q 64 wide, K and V 32 each), its shapes fixed, every group merged:
    in each layer K and V as a pair (Q, wider, stays apart), their parts reaching the rotary embedding and the
    attention through the split, and gate and up (256 each), their parts reaching SiLU and the product; the build
    on llvm gives onnxruntime's outputs."""
    import hf_export
    import onnx

    path = hf_export.export("llama", exporter, str(tmp_path), ids_only=True)
    model = onnx.load(path)
    imp = import_model(model, {"input_ids": [2, 7]})
    merged = []
    bound = prepare_module(imp, merge_pays=ALWAYS, merged=merged)
    assert sorted((n, count) for _, n, _, count in merged) == [(32, 2), (32, 2), (256, 2), (256, 2)], merged
    fused = lower(bound)
    assert "tvmfuse.attention" in set(fused.kernel_patterns.values())
    check = check_against_ort(model, imp, fused, resolve_target("llvm"))
    assert check.ok, check
