"""Tiny Hugging Face GPT-2 / BERT / Llama exported by torch.onnx (legacy and dynamo), imported, built, run vs ORT."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import detach_params

import tvmfuse.frontend.convert as fe

pytest.importorskip("transformers")
import hf_export  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

pytestmark = pytest.mark.slow
CASES = [(m, e) for m in ("gpt2", "bert", "llama") for e in ("legacy", "dynamo")]
SHAPES = [(1, 3), (2, 7), (3, 16)]
ATOL = 1e-4


@pytest.fixture(scope="session")
def hf_onnx(hf_exports):
    """(path, loaded model) of each (model, exporter), from conftest's session-wide exports (made once)."""
    cache: dict = {}

    def get(name: str, exporter: str) -> tuple[str, onnx.ModelProto]:
        if (name, exporter) not in cache:
            path = hf_exports(name, exporter)
            cache[(name, exporter)] = (path, onnx.load(path))
        return cache[(name, exporter)]

    return get


def kernel_count(lowered: tvm.IRModule) -> int:
    """PrimFunc calls left in main after the zero pipeline, reshapes rewritten to views as the build does."""
    lowered = relax.transform.RewriteDataflowReshape()(lowered)
    return len(re.findall(r"R\.call_tir\(", lowered["main"].script()))


def build(mod):
    mod, params = detach_params(mod)
    lowered = relax.get_pipeline("zero")(mod)
    ex = tvm.compile(lowered, target=tvm.target.Target({"kind": "llvm"}))
    return relax.VirtualMachine(ex, tvm.cpu()), params.get("main", []), kernel_count(lowered)


def check(path, vm, params, shapes):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for batch, seq in shapes:
        feeds = hf_export.example_inputs(batch, seq, seed=batch * 100 + seq)
        feeds["attention_mask"][0, :1] = 0  # a padded position
        ref = sess.run(None, feeds)[0]
        out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()], *params).numpy()
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0, err_msg=f"(batch, seq) = {(batch, seq)}")


@pytest.mark.parametrize("name,exporter", CASES)
def test_symbolic_dims_one_build_three_shapes(hf_onnx, name, exporter):
    path, model = hf_onnx(name, exporter)
    mod = fe.from_onnx(model)
    assert [str(p.ty) for p in mod["main"].params[:2]] == ['R.Tensor((batch, seq), dtype="int64")'] * 2
    vm, params, kernels = build(mod)
    assert kernels <= 60  # observed 47-54: the mask/shape subgraphs stay a handful of fused kernels
    check(path, vm, params, SHAPES)


@pytest.mark.parametrize("name,exporter", CASES)
def test_fixed_shapes(hf_onnx, name, exporter):
    path, model = hf_onnx(name, exporter)
    mod = fe.from_onnx(model, shape_dict={"input_ids": [2, 7], "attention_mask": [2, 7]})
    assert [str(p.ty) for p in mod["main"].params[:2]] == ['R.Tensor((2, 7), dtype="int64")'] * 2
    vm, params, kernels = build(mod)
    assert kernels <= 45  # observed 41-44: shape arithmetic and static mask parts are folded away
    check(path, vm, params, [(2, 7)])
