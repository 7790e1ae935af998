"""Unit tests for tvmfuse.frontend: one tiny onnx.helper model per converter fix, checked against onnxruntime."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh
from tvm import relax
from tvm.relax.frontend import detach_params
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

import tvmfuse.frontend.convert as fe
from tvmfuse.frontend.convert_map import convert_map
from tvmfuse.errors import ModelError
from tvmfuse.frontend.graph_importer import import_graph
from tvmfuse.frontend.preprocess import inline_small_initializers

warnings.filterwarnings("ignore", category=UserWarning)
F, I64 = TP.FLOAT, TP.INT64


def vi(name, dtype, shape):
    return oh.make_tensor_value_info(name, dtype, shape)


def const(name, value, dtype=np.int64):
    return nh.from_array(np.asarray(value, dtype=dtype), name)


def make(nodes, inputs, outputs, inits=(), opset=18):
    graph = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def run_vs_ort(model, mod, feeds_list, atol=1e-5):
    """Build `mod` once for llvm; for each feed dict compare with onnxruntime."""
    mod, params = detach_params(mod)
    ex = tvm.compile(relax.get_pipeline("zero")(mod), target=tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        ref = sess.run(None, feeds)[0]
        out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()], *params.get("main", []))
        out = out.numpy()
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=atol, rtol=0)


def convert(model):
    """The tvmfuse converters alone: no onnxruntime folding, initializers as constants."""
    return import_graph(model, keep_params_in_input=False)


def ret_shape(mod) -> str:
    return str(mod["main"].ret_ty)


def rand(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype("float32")


# --- shape-valued inputs -------------------------------------------------------------------------------------

def test_constant_of_shape_rank0_target():
    """A 1-element fill value with an empty target shape gives a scalar (TVM: broadcast_to ndim error)."""
    cos = oh.make_node("ConstantOfShape", ["s"], ["c"], value=oh.make_tensor("v", F, [1], [3.0]))
    model = make([cos, oh.make_node("Add", ["x", "c"], ["y"])], [vi("x", F, ["n"])], [vi("y", F, ["n"])],
                 [const("s", np.zeros(0))])
    mod = convert(model)  # converter only, no onnxruntime folding
    run_vs_ort(model, mod, [{"x": rand(3)}, {"x": rand(5)}])


def test_constant_of_shape_symbolic_target():
    nodes = [oh.make_node("Shape", ["x"], ["s"]),
             oh.make_node("ConstantOfShape", ["s"], ["c"], value=oh.make_tensor("v", F, [1], [2.0])),
             oh.make_node("Mul", ["x", "c"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", F, ["n", "m"])])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((n, m), dtype="float32")'
    run_vs_ort(model, mod, [{"x": rand(2, 3)}, {"x": rand(4, 1)}])


def test_reshape_of_computed_dim_one_plus_seq():
    """`1 + seq` reshaped to [-1] then used as a target shape stays symbolic (TVM: 'given input is ir.PrimType')."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["d"], axis=0),
             oh.make_node("Add", ["one", "d"], ["d1"]), oh.make_node("Reshape", ["d1", "m1"], ["d1v"]),
             oh.make_node("Concat", ["m1", "d1v"], ["ns"], axis=0), oh.make_node("Pad", ["x", "pads"], ["xp"]),
             oh.make_node("Reshape", ["xp", "ns"], ["y"])]
    inits = [const("i1", 1), const("one", 1), const("m1", [-1]), const("pads", [0, 0, 0, 1])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", F, ["n", "M"])], inits)
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((n, 1 + m), dtype="float32")'
    run_vs_ort(model, mod, [{"x": rand(2, 3)}, {"x": rand(3, 6)}])


def test_reshape_to_runtime_tensor_shape():
    """A target shape that is a run-time int64 tensor (here shape * 1) goes through tensor_to_shape."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Mul", ["s", "one"], ["s2"]),
             oh.make_node("Relu", ["x"], ["r"]), oh.make_node("Reshape", ["r", "s2"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", F, ["n", "m"])], [const("one", [1, 1])])
    mod = convert(model)
    run_vs_ort(model, mod, [{"x": rand(2, 3)}, {"x": rand(5, 2)}])


def test_reshape_minus_one_cancels_the_dims_the_target_keeps():
    """The KV cache's [n, 4, p + s, 8] -> [-1, p + s, 8], the target built from its Shape (the dynamo exporter's
    SDPA): -1 is n * 4, not TVM's undivided `n * (p + s) * 32 // (p * 8 + s * 8)` (whose CUDA host code then
    failed to compile: "Binding of variable rmod ... conflicts with previous binding")."""
    nodes = [oh.make_node("Concat", ["past", "new"], ["kv"], axis=2), oh.make_node("Shape", ["kv"], ["s"]),
             oh.make_node("Slice", ["s", "st", "en"], ["tail"]), oh.make_node("Concat", ["m1", "tail"], ["ns"], axis=0),
             oh.make_node("Reshape", ["kv", "ns"], ["y"])]
    model = make(nodes, [vi("past", F, ["n", 4, "p", 8]), vi("new", F, ["n", 4, "s", 8])], [vi("y", F, ["nh", "t", 8])],
                 [const("st", [-2]), const("en", [4]), const("m1", [-1])])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((n * 4, p + s, 8), dtype="float32")'
    run_vs_ort(model, mod, [{"past": rand(2, 4, 3, 8), "new": rand(2, 4, 1, 8)},
                            {"past": rand(1, 4, 5, 8), "new": rand(1, 4, 2, 8)}])


def test_range_to_symbolic_dim_has_that_length():
    """Range(0, seq, 1) has length `seq`, so adding it to a (n, seq) tensor keeps the dims (TVM: fresh dim)."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["d"], axis=0),
             oh.make_node("Range", ["zero", "d", "one"], ["r"]), oh.make_node("Cast", ["r"], ["rf"], to=F),
             oh.make_node("Add", ["x", "rf"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", F, ["n", "m"])],
                 [const("i1", 1), const("one", 1), const("zero", 0)])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((n, m), dtype="float32")'
    run_vs_ort(model, mod, [{"x": rand(2, 3)}, {"x": rand(1, 7)}])


@pytest.mark.parametrize("op,length", [("Add", 8), ("Sub", 8), ("Mul", 8), ("Add", 1)])
def test_a_symbolic_dim_with_a_constant_array_is_computed_as_tensors(op, length):
    """`past + arange(seq)` once seq is fixed (the decoder step at `--shape seq=8`): the past length (a symbolic
    dim gathered from a shape) meets a constant array; TVM's converter folds it in numpy and fails (`can only
    convert an array of size 1 to a Python scalar`)."""
    from tvmfuse.frontend.shape_ops import check_dim_meets_array

    nodes = [oh.make_node("Shape", ["past"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["d"], axis=0),
             oh.make_node(op, ["pos", "d"], ["y"])]
    model = make(nodes, [vi("past", F, [1, "p"])], [vi("y", I64, [length])],
                 [const("i1", 1), const("pos", range(length))])
    mod = convert(model)
    assert ret_shape(mod) == f'R.Tensor(({length},), dtype="int64")'
    run_vs_ort(model, mod, [{"past": rand(1, 5)}, {"past": rand(1, 11)}])
    dim = tvm.tirx.Var("p", "int64")
    assert check_dim_meets_array([relax.const(np.arange(8)), dim])
    assert check_dim_meets_array([relax.const(np.arange(1)), dim])  # TVM's own path made it a scalar
    assert not check_dim_meets_array([relax.const(np.int64(3)), dim])  # a scalar: TVM's own path folds it
    assert not check_dim_meets_array([relax.const(np.arange(8)), relax.const(np.arange(8))])


def test_gather_of_shape_with_vector_indices_stays_a_shape():
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "perm"], ["t"], axis=0),
             oh.make_node("Reshape", ["x", "t"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", F, ["m", "n"])], [const("perm", [1, 0])])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((m, n), dtype="float32")'
    run_vs_ort(model, mod, [{"x": rand(2, 3)}])


def test_expand_of_tensor_with_unknown_dims():
    bb = relax.BlockBuilder()
    n, m = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType(ndim=2, dtype="float32"))
    with bb.function("main", [x]):
        out = convert_map()["Expand"].get_converter(18)(
            bb, [x, relax.ShapeExpr([n, m])], {}, [{}, {}])
        assert str(bb.normalize(out).ty) == 'R.Tensor((n, m), dtype="float32")'
        with pytest.raises(ValueError, match="1s"):
            convert_map()["Expand"].get_converter(18)(bb, [x, relax.ShapeExpr([n, 1])], {}, [{}, {}])
        bb.emit_func_output(x)


def test_shape_fed_to_elementwise_op_becomes_tensor():
    """TVM rejects a shape input to ops outside its shape-aware list ('cannot handle ShapeExpr inputs')."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["d"], axis=0),
             oh.make_node("Unsqueeze", ["d", "ax"], ["dv"]), oh.make_node("Shape", ["x"], ["s2"]),
             oh.make_node("Slice", ["s2", "st", "en"], ["dn"]),  # a 1-element shape
             oh.make_node("Mul", ["dn", "two"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"])], [vi("y", I64, [1])],
                 [const("i1", 1), const("ax", [0]), const("st", [1]), const("en", [2]), const("two", [2])])
    mod = convert(model)
    run_vs_ort(model, mod, [{"x": rand(2, 3)}, {"x": rand(2, 5)}])


def test_arithmetic_on_a_static_dim_folds_so_a_slice_keeps_its_dims():
    """torch.split / chunk as exported (GPT-NeoX's fused QKV): the slice bounds are `(Shape(x)[-1] + 2) // 3 * k`
    of a static last dim; fed to Add as a runtime tensor they made a dynamic slice that lost every dim (and the
    export's present K/V outputs with it); as a constant they fold, and the slice is (n, 4)."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Gather", ["s", "last"], ["d"], axis=0),
             oh.make_node("Add", ["d", "two"], ["d2"]), oh.make_node("Div", ["d2", "three"], ["third"]),
             oh.make_node("Slice", ["x", "zero", "third", "last"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", 12])], [vi("y", F, ["n", 4])],
                 [const("last", [-1]), const("two", [2]), const("three", [3]), const("zero", [0])])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((n, 4), dtype="float32")'
    run_vs_ort(model, mod, [{"x": rand(2, 12)}, {"x": rand(5, 12)}])


def test_a_slice_to_the_end_from_a_symbolic_start_has_the_rest_of_the_dim():
    """OPT's `positions[:, past:]`, exported with end INT64_MAX: (b, total - past), where TVM's converter made the
    length INT64_MAX - past; added to the step's (b, seq, 4) embeddings, whose seq TVM cannot prove equal to
    total - past, the sum keeps (b, seq, 4): the other input is cast to it (checked when the model runs), where the
    sum had lost every dim and could not be lowered."""
    nodes = [oh.make_node("Shape", ["past"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["p"], axis=0),
             oh.make_node("Unsqueeze", ["p", "ax0"], ["start"]),
             oh.make_node("Slice", ["mask", "start", "big", "ax1"], ["pos"]),
             oh.make_node("Unsqueeze", ["pos", "ax2"], ["pos3"]), oh.make_node("Cast", ["pos3"], ["posf"], to=F),
             oh.make_node("Add", ["emb", "posf"], ["y"])]
    model = make(nodes, [vi("emb", F, ["b", "seq", 4]), vi("mask", I64, ["b", "total"]), vi("past", F, ["b", "past"])],
                 [vi("y", F, ["b", "seq", 4])],
                 [const("i1", 1), const("ax0", [0]), const("ax1", [1]), const("ax2", [2]),
                  const("big", [np.iinfo(np.int64).max])])
    mod = convert(model)
    assert ret_shape(mod) == 'R.Tensor((b, seq, 4), dtype="float32")'
    mask = np.arange(14, dtype=np.int64).reshape(2, 7)
    run_vs_ort(model, mod, [{"emb": rand(2, 3, 4), "mask": mask, "past": rand(2, 4)},
                            {"emb": rand(2, 1, 4), "mask": mask[:, :5], "past": rand(2, 4)}])


def test_lost_dims_are_named_so_reshape_infers():
    """A Slice with run-time starts has unknown dims; a later Reshape to [-1] needs them (TVM: 'has no shape')."""
    nodes = [oh.make_node("Slice", ["x", "st", "en"], ["a"]), oh.make_node("Reshape", ["a", "m1"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"]), vi("st", I64, [2])], [vi("y", F, ["nm"])],
                 [const("m1", [-1]), const("en", [100, 100])])
    mod = convert(model)
    run_vs_ort(model, mod, [{"x": rand(3, 4), "st": np.array([1, 2])}, {"x": rand(2, 2), "st": np.array([0, 1])}])


# --- mask-building ops ----------------------------------------------------------------------------------------

def test_causal_mask_with_cumsum_where_isnan():
    """The pieces exporters emit for masks: CumSum over the padding mask, a causal compare, Where, IsNaN."""
    nodes = [oh.make_node("CumSum", ["mask", "ax"], ["pos"]),
             oh.make_node("Shape", ["mask"], ["s"]), oh.make_node("Gather", ["s", "i1"], ["d"], axis=0),
             oh.make_node("Range", ["zero", "d", "one"], ["r"]),
             oh.make_node("Unsqueeze", ["r", "ax0"], ["rq"]), oh.make_node("Unsqueeze", ["r", "ax1"], ["rk"]),
             oh.make_node("LessOrEqual", ["rq", "rk"], ["causal"]),
             oh.make_node("Where", ["causal", "fzero", "ninf"], ["bias"]),
             oh.make_node("Cast", ["pos"], ["posf"], to=F), oh.make_node("Unsqueeze", ["posf", "ax1"], ["p3"]),
             oh.make_node("Add", ["p3", "bias"], ["sc"]), oh.make_node("Softmax", ["sc"], ["sm"], axis=-1),
             oh.make_node("IsNaN", ["sm"], ["nan"]), oh.make_node("Where", ["nan", "fzero", "sm"], ["y"])]
    inits = [const("ax", 1), const("i1", 1), const("zero", 0), const("one", 1), const("ax0", [0]),
             const("ax1", [1]), const("fzero", 0.0, np.float32), const("ninf", -np.inf, np.float32)]
    model = make(nodes, [vi("mask", I64, ["b", "s"])], [vi("y", F, ["b", "s", "s"])], inits)
    for mod in (import_graph(inline_small_initializers(model), keep_params_in_input=True), fe.from_onnx(model)):
        assert ret_shape(mod) == 'R.Tensor((b, s, s), dtype="float32")'
        m = np.ones((3, 5), np.int64)
        m[0, :2] = 0
        run_vs_ort(model, mod, [{"mask": m}, {"mask": np.ones((1, 2), np.int64)}])


def test_gather_nd_batch_dims_symbolic():
    model = make([oh.make_node("GatherND", ["x", "idx"], ["y"], batch_dims=1)],
                 [vi("x", F, ["b", "s", 4]), vi("idx", I64, ["b", 3, 1])], [vi("y", F, ["b", 3, 4])])
    mod = fe.from_onnx(model)
    assert ret_shape(mod) == 'R.Tensor((b, 3, 4), dtype="float32")'
    idx = np.array([[[0], [2], [1]], [[1], [1], [0]]], np.int64)
    run_vs_ort(model, mod, [{"x": rand(2, 3, 4), "idx": idx}])


def test_where_on_shape_values():
    """The legacy exporter's expand idiom: `where(shape == -1 * ones_like(shape), 1, shape)` stays a shape."""
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Shape", ["s"], ["rank"]),
             oh.make_node("ConstantOfShape", ["rank"], ["ones"], value=oh.make_tensor("v", I64, [1], [1])),
             oh.make_node("Mul", ["ones", "neg"], ["negs"]), oh.make_node("Equal", ["s", "negs"], ["e"]),
             oh.make_node("Where", ["e", "ones", "s"], ["t"]), oh.make_node("Expand", ["b", "t"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"]), vi("b", F, [1, "m"])], [vi("y", F, ["n", "m"])],
                 [const("neg", -1)])
    for mod in (convert(model), fe.from_onnx(model)):
        assert ret_shape(mod) == 'R.Tensor((n, m), dtype="float32")'
        run_vs_ort(model, mod, [{"x": rand(2, 3), "b": rand(1, 3)}])


def test_equal_of_shape_and_runtime_tensor():
    nodes = [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Equal", ["s", "t"], ["y"])]
    model = make(nodes, [vi("x", F, ["n", "m"]), vi("t", I64, [2])], [vi("y", TP.BOOL, [2])])
    mod = convert(model)
    run_vs_ort(model, mod, [{"x": rand(2, 3), "t": np.array([2, 4])}, {"x": rand(4, 4), "t": np.array([2, 4])}])


# --- entry point, pre-processing, errors ----------------------------------------------------------------------

def _mlp(batch="n"):
    nodes = [oh.make_node("MatMul", ["x.in", "W"], ["h"]), oh.make_node("Reshape", ["h", "shp"], ["y"])]
    inits = [const("W", rand(4, 6), np.float32), const("shp", [0, 2, 3])]
    return make(nodes, [vi("x.in", F, [batch, 4])], [vi("y", F, [batch, 2, 3])], inits)


def test_only_weights_become_params_and_names_are_sanitized():
    mod = fe.from_onnx(_mlp())
    assert [p.name for p in mod["main"].params] == ["x_in", "W"]
    assert int(mod["main"].attrs["num_input"]) == 1
    mod = fe.from_onnx(_mlp(), keep_params_in_input=False)
    assert [p.name for p in mod["main"].params] == ["x_in"]


def test_shape_dict_specialises_or_renames():
    model = _mlp()
    assert ret_shape(fe.from_onnx(model)) == 'R.Tensor((n, 2, 3), dtype="float32")'
    fixed = fe.from_onnx(model, shape_dict={"x.in": [5, 4]})
    assert ret_shape(fixed) == 'R.Tensor((5, 2, 3), dtype="float32")'
    run_vs_ort(model, fixed, [{"x.in": rand(5, 4)}])
    assert ret_shape(fe.from_onnx(model, shape_dict={"x.in": ["batch", 4]})) == \
        'R.Tensor((batch, 2, 3), dtype="float32")'
    with pytest.raises(ModelError, match="3 dims"):
        fe.from_onnx(model, shape_dict={"x.in": [1, 2, 3]})


def _custom_op_model():
    nodes = [oh.make_node("MyOp", ["x"], ["h"], name="my_node", domain="com.example"),
             oh.make_node("Relu", ["h"], ["y"], name="relu")]
    graph = oh.make_graph(nodes, "g", [vi("x", F, ["n"])], [vi("y", F, ["n"])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.example", 1)])


def test_unsupported_ops_lists_without_converting():
    assert fe.unsupported_ops(_custom_op_model()) == [("MyOp", "my_node")]
    assert fe.unsupported_ops(_mlp()) == []
    with pytest.raises(ModelError, match=r"^cannot import ONNX op MyOp \(node 'my_node'\): no Relax converter"):
        fe.from_onnx(_custom_op_model())


def test_converter_failure_names_op_and_node():
    """CumSum with a run-time axis cannot be imported: the error says which node and why, in one line."""
    node = oh.make_node("CumSum", ["x", "axis"], ["y"], name="cumsum_rt")
    model = make([node], [vi("x", F, ["n"]), vi("axis", I64, [])], [vi("y", F, ["n"])])
    with pytest.raises(ModelError) as info:
        fe.from_onnx(model)
    msg = str(info.value)
    assert msg.startswith("cannot import ONNX op CumSum (node 'cumsum_rt'): ") and "axis" in msg
    assert "\n" not in msg


def test_tvm_converter_map_is_not_modified():
    fe.from_onnx(_mlp())
    stock = tvm_onnx._get_convert_map()
    ours = convert_map()
    for op in ("Range", "Reshape", "Gather", "Expand", "ConstantOfShape", "Slice", "Add", "Sub", "Mul", "Div"):
        assert stock[op].__module__ == tvm_onnx.__name__
        assert ours[op] is not stock[op] and issubclass(ours[op], stock[op])
