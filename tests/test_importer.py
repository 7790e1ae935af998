"""Import stage: shapes, symbolic dims, and one clear ModelError per bad input."""

import onnx
import pytest

import onnx_models
from tvmfuse.errors import ModelError
from tvmfuse.frontend.importer import import_model, load_onnx
from tvmfuse.verify import random_inputs


def test_static_model_imports_with_detached_weights():
    imp = import_model(onnx_models.layer_norm_gelu(rows=8, hidden=64))
    assert [t.as_dict() for t in imp.inputs] == [{"name": "x", "shape": [8, 64], "dtype": "float32"}]
    assert [t.name for t in imp.outputs] == ["y"]
    assert len(imp.params) == 2 and imp.symbolic_dims == []
    assert int(imp.mod["main"].attrs["num_input"]) == 1


def test_symbolic_dim_is_kept_or_fixed_by_name_or_by_input():
    model = onnx_models.layer_norm_gelu(hidden=64, dyn=True)
    assert import_model(model).symbolic_dims == ["batch"]
    assert import_model(model).inputs[0].shape == ["batch", 64]
    assert import_model(model, {"batch": [3]}).inputs[0].shape == [3, 64]
    assert import_model(model, {"x": [5, 64]}).inputs[0].shape == [5, 64]


@pytest.mark.parametrize("shapes, message", [
    ({"x": [5]}, "--shape x has 1 dims, the input has 2"),
    ({"nope": [5]}, "no input or symbolic dim of that name (inputs: x; symbolic dims: batch)"),
    ({"batch": [0]}, "dims must be positive"),
])
def test_bad_shapes_name_the_problem(shapes, message):
    with pytest.raises(ModelError, match=None) as err:
        import_model(onnx_models.layer_norm_gelu(hidden=64, dyn=True), shapes)
    assert message in str(err.value)


def test_bad_files_get_one_clear_error(tmp_path):
    good = tmp_path / "good.onnx"
    onnx.save(onnx_models.layer_norm_gelu(), good)
    data = good.read_bytes()
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "trunc.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.onnx").write_text("this is not a model\n" * 10)
    cases = {"missing.onnx": "no such file", "empty.onnx": "empty file", "trunc.onnx": "ONNX",
             "text.onnx": "ONNX"}
    for name, message in cases.items():
        with pytest.raises(ModelError) as err:
            load_onnx(str(tmp_path / name))
        text = str(err.value)
        assert name in text and message in text and "\n" not in text


def test_unsupported_operator_is_named_with_its_node():
    with pytest.raises(ModelError, match=r"operator NoSuchOp \(node mystery_node\) is not supported"):
        import_model(onnx_models.with_op("NoSuchOp"))


def test_random_inputs_respect_shapes_and_dtypes():
    imp = import_model(onnx_models.layer_norm_gelu(hidden=64, dyn=True))
    feeds = random_inputs(imp.inputs, dims={"batch": 3})
    assert feeds["x"].shape == (3, 64) and feeds["x"].dtype == "float32"


def _two_tables(rows_a: int, rows_b: int):
    """ids -> Cast -> Gather(table_a) + Gather(table_b, ids); types -> Gather(table_t); flags: no table."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    init = [numpy_helper.from_array(np.ones((r, 4), np.float32), n) for n, r in
            (("table_a", rows_a), ("table_b", rows_b), ("table_t", 3))]
    nodes = [helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Gather", ["table_a", "ids32"], ["a"]),
             helper.make_node("Gather", ["table_b", "ids"], ["b"]),
             helper.make_node("Gather", ["table_t", "types"], ["t"]),
             helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "t"], ["abt"]),
             helper.make_node("Cast", ["flags"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["f", "axes"], ["f2"]), helper.make_node("Mul", ["abt", "f2"], ["y"])]
    init.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    graph = helper.make_graph(nodes, "tables", [helper.make_tensor_value_info(n, TensorProto.INT64, [64])
                                                for n in ("ids", "types", "flags")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 4])], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_token_ids_are_drawn_over_the_rows_of_the_table_they_index():
    """Verification's ids span the embedding table (through a Cast; the smaller table's rows where two are
    indexed), not just 0 and 1; an integer input that indexes no table keeps 0 and 1."""
    imp = import_model(_two_tables(1000, 300))
    assert {t.name: t.index_bound for t in imp.inputs} == {"ids": 300, "types": 3, "flags": None}
    feeds = random_inputs(imp.inputs)
    assert 100 < feeds["ids"].max() < 300 and len(set(feeds["ids"].tolist())) > 40
    assert set(feeds["types"].tolist()) == {0, 1, 2} and set(feeds["flags"].tolist()) <= {0, 1}


def test_an_output_whose_dims_the_import_loses_keeps_the_dims_its_graph_declares():
    """A slice of runtime bounds has no dims in Relax (TVM cannot know them); the output's info takes the ONNX
    graph's declared dims (it was an internal error, TypeError on None dims: GPT-NeoX's decoder step)."""
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    nodes = [helper.make_node("Slice", ["x", "start", "end"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8]),
                                           helper.make_tensor_value_info("end", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 8])],
                              [helper.make_tensor("start", TensorProto.INT64, [1], [0])])
    imp = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert imp.mod["main"].ret_ty.shape is None  # what TVM knows
    assert [t.as_dict() for t in imp.outputs] == [{"name": "y", "shape": ["m", 8], "dtype": "float32"}]


def _step(with_positions: bool):
    """A decoder step's dims: present = Concat(past, x) declared [b, "total"], the mask [b, total]; with
    `with_positions`, OPT's positions: the mask sliced [past:] (to INT64_MAX) and added to x."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Concat", ["past", "x"], ["present"], axis=1)]
    inits = []
    if with_positions:
        nodes += [helper.make_node("Shape", ["past"], ["s"]), helper.make_node("Gather", ["s", "one"], ["p"], axis=0),
                  helper.make_node("Unsqueeze", ["p", "zero"], ["start"]),
                  helper.make_node("Slice", ["mask", "start", "end", "one1"], ["pos"]),
                  helper.make_node("Cast", ["pos"], ["posf"], to=f), helper.make_node("Add", ["x", "posf"], ["y"])]
        inits = [helper.make_tensor("one", i64, [], [1]), helper.make_tensor("zero", i64, [1], [0]),
                 helper.make_tensor("one1", i64, [1], [1]),
                 helper.make_tensor("end", i64, [1], [int(np.iinfo(np.int64).max)])]
    else:
        nodes += [helper.make_node("Cast", ["mask"], ["y"], to=f)]
    outputs = [helper.make_tensor_value_info("present", f, ["b", "total"]),
               helper.make_tensor_value_info("y", f, ["b", "seq" if with_positions else "total"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["b", "seq"]),
                                           helper.make_tensor_value_info("mask", i64, ["b", "total"]),
                                           helper.make_tensor_value_info("past", f, ["b", "past"])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("with_positions", [True, False])
def test_a_declared_output_dim_binds_an_input_dim_only_where_it_is_subtracted(with_positions):
    """The mask's `total` is declared at the present output, which the import computes as past + seq: where the
    graph slices the mask [past:] (total - past, which FuseTIR cannot pass to a kernel) `total` becomes past + seq
    and the slice is seq long; elsewhere it stays a dim of its own (the interface unchanged)."""
    imp = import_model(_step(with_positions))
    mask = next(t for t in imp.inputs if t.name == "mask")
    assert mask.shape == (["b", "past + seq"] if with_positions else ["b", "total"]), mask
    assert [t.shape for t in imp.outputs] == [["b", "past + seq"], ["b", "seq" if with_positions else "total"]]
    assert sorted(imp.symbolic_dims) == (["b", "past", "seq"] if with_positions else ["b", "past", "seq", "total"])
