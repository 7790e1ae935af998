"""Verify stage: tolerances by dtype, NaN handling, shape and count mismatches."""

import numpy as np
import pytest

from tvmfuse.verify.outputs import compare, module_inputs


def test_fp32_tolerance_is_1e4():
    want = np.zeros((4, 4), "float32")
    assert compare([want + 5e-5], [want]).ok
    check = compare([want + 5e-4], [want])
    assert not check.ok and check.max_abs_err == pytest.approx(5e-4, rel=1e-3)


def test_fp16_tolerance_is_1e2():
    want = np.zeros(8, "float16")
    assert compare([want + np.float16(5e-3)], [want]).ok
    assert not compare([want + np.float16(5e-2)], [want]).ok


def test_bf16_tolerance_is_8e2_ten_epsilons_as_fp16s_is():
    """fp16's 1e-2 is ~10 x 2^-10; bf16's is ~10 x 2^-7 = 7.8e-2 -> 8e-2 (an fp32 output of a bf16 build too)."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    want = np.zeros(8, ml_dtypes.bfloat16)
    assert compare([want + ml_dtypes.bfloat16(7e-2)], [want]).ok
    assert not compare([want + ml_dtypes.bfloat16(1e-1)], [want]).ok
    f32 = np.zeros(8, "float32")
    assert compare([f32 + 7e-2], [f32], compute_dtype="bfloat16").ok
    assert not compare([f32 + 7e-2], [f32], compute_dtype="float16").ok


def test_nan_only_where_the_reference_has_nan():
    want = np.array([1.0, np.nan], "float32")
    assert compare([want.copy()], [want]).ok
    assert not compare([np.array([np.nan, np.nan], "float32")], [want]).ok


def test_the_same_infinity_agrees_and_another_value_does_not():
    """A mask kernel's -inf where the reference has -inf is agreement (inf - inf was NaN, counted as an error)."""
    want = np.array([-np.inf, np.inf, 1.0], "float32")
    check = compare([want.copy()], [want])
    assert check.ok and check.max_abs_err == 0.0
    assert not compare([np.array([np.inf, np.inf, 1.0], "float32")], [want]).ok
    assert not compare([np.array([-1e30, np.inf, 1.0], "float32")], [want]).ok


def test_mismatched_outputs_raise():
    with pytest.raises(ValueError, match="returned 1 outputs, onnxruntime 2"):
        compare([np.zeros(2)], [np.zeros(2), np.zeros(2)])
    with pytest.raises(ValueError, match="shape"):
        compare([np.zeros(2)], [np.zeros(3)])


@pytest.mark.parametrize("io_dtype", ["float16", "bfloat16"])
def test_low_interface_inputs_and_outputs(io_dtype):
    """A module with an fp16/bf16 interface gets its float32 inputs cast (ints untouched), and its fp16/bf16
    outputs compare with onnxruntime's float32 ones at the compute dtype's tolerance."""
    x, ids = np.array([1.0, 1000 / 3], "float32"), np.array([1, 2], "int64")
    cast_x, same_ids = module_inputs([x, ids], io_dtype)
    assert str(cast_x.dtype) == io_dtype and same_ids is ids
    assert module_inputs([x], None)[0] is x
    got = cast_x  # 1000/3 rounded to the low dtype: within its tolerance of the float32 value, not fp32's
    assert compare([got], [x], compute_dtype=io_dtype).ok
    assert not compare([got], [x]).ok


def test_user_tolerance_replaces_the_dtype_default_both_ways():
    """A user (atol, rtol) passes what the default fails and fails what it passes, for every float output, and the
    reported tolerance says it was user-set."""
    want32 = np.zeros((4, 4), "float32")
    assert not compare([want32 + 5e-4], [want32]).ok  # fp32 default: 1e-4
    looser = compare([want32 + 5e-4], [want32], user_tolerance=(1e-3, 0.0))
    assert looser.ok and looser.tolerance == {"float32": {"atol": 1e-3, "rtol": 0.0, "set_by": "user"}}
    want16 = np.zeros(8, "float16")
    assert compare([want16 + np.float16(5e-3)], [want16]).ok  # fp16 default: 1e-2
    assert not compare([want16 + np.float16(5e-3)], [want16], user_tolerance=(1e-3, 1e-3)).ok
    # it also replaces the compute dtype's looser default (fp32 outputs of an fp16 build)
    assert compare([want32 + 5e-3], [want32], compute_dtype="float16").ok
    assert not compare([want32 + 5e-3], [want32], compute_dtype="float16", user_tolerance=(1e-3, 1e-3)).ok
    # rtol scales with |onnxruntime|: 1% of 100 covers an error of 1
    hundred = np.full(3, 100.0, "float32")
    assert compare([hundred + 1.0], [hundred], user_tolerance=(0.0, 0.011)).ok
    assert not compare([hundred + 1.0], [hundred], user_tolerance=(0.0, 0.009)).ok


def test_user_tolerance_leaves_integer_outputs_exact():
    ids = np.array([1, 2, 3], "int64")
    check = compare([ids + 1, np.zeros(2, "float32")], [ids, np.zeros(2, "float32")], user_tolerance=(10.0, 10.0))
    assert not check.ok
    assert check.tolerance["int64"] == {"atol": 0.0, "rtol": 0.0}
    assert check.tolerance["float32"]["set_by"] == "user"


def test_tolerance_text_says_what_was_applied():
    want = np.zeros(2, "float16")
    assert compare([want], [want]).tolerance_text() == "atol=0.01 rtol=0.01 for float16 outputs"
    check = compare([want, np.zeros(2, "float32")], [want, np.zeros(2, "float32")], user_tolerance=(0.05, 0.02))
    assert check.tolerance_text() == "atol=0.05 rtol=0.02 (user-set) for float16, float32 outputs"
    mixed = compare([want, np.zeros(2, "float32")], [want, np.zeros(2, "float32")])
    assert mixed.tolerance_text() == ("atol=0.01 rtol=0.01 for float16 outputs; "
                                      "atol=0.0001 rtol=0.0001 for float32 outputs")


def test_compare_counts_elements_outside_tolerance_and_the_rms_error():
    from tvmfuse.verify.outputs import compare
    want = [np.zeros(4, np.float32), np.ones(2, np.float32)]
    got = [np.array([0, 2e-4, 0, 0], np.float32), np.array([1, 1 + 3e-4], np.float32)]
    check = compare(got, want)  # fp32: atol 1e-4 + rtol 1e-4 * |want|: 2e-4 and 3e-4 are both outside
    assert not check.ok and check.violations == 2
    assert np.isclose(check.rms_err, np.sqrt((2e-4 ** 2 + 3e-4 ** 2) / 6), rtol=1e-3)


def test_a_reference_child_that_cannot_load_the_model_says_why_in_one_line(tmp_path):
    """A big model's reference runs in a child process: a model onnxruntime cannot load (here IR version 99) comes
    back as the child's one line (ModelError's, naming onnxruntime and the IR version), not its traceback."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    from tvmfuse.errors import TvmfuseError  # pylint: disable=import-outside-toplevel
    from tvmfuse.verify.child_reference import reference_in_child  # pylint: disable=import-outside-toplevel

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = str(tmp_path / "ir99.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=99), path)
    with pytest.raises(TvmfuseError) as info:
        reference_in_child(path, {"x": np.ones(2, "float32")})
    message = str(info.value)
    assert message.startswith(f"{path}: onnxruntime ") and "cannot load it (ONNX IR version 99" in message, message
    assert "Traceback" not in message and "\n" not in message



def test_a_reference_child_given_inputs_the_model_cannot_run_says_why_in_one_line(tmp_path):
    """The child's onnxruntime run fails on the inputs (a position past the table's end): its one line, naming
    the node, comes back (it was the child's traceback's last line, after 'the onnxruntime reference failed')."""
    import onnx  # pylint: disable=import-outside-toplevel

    import onnx_models  # pylint: disable=import-outside-toplevel
    from tvmfuse.errors import TvmfuseError  # pylint: disable=import-outside-toplevel
    from tvmfuse.verify.child_reference import reference_in_child  # pylint: disable=import-outside-toplevel

    path = str(tmp_path / "pos.onnx")
    onnx.save(onnx_models.learned_positions(positions=16), path)
    outputs, _ = reference_in_child(path, {"ids": np.zeros((1, 16), "int64")})
    assert outputs[0].shape == (1, 16, 8)
    with pytest.raises(TvmfuseError) as info:
        reference_in_child(path, {"ids": np.zeros((2, 17), "int64")})
    message = str(info.value)
    assert message.startswith("onnxruntime cannot run the model on these inputs (ids 2x17): its "), message
    assert "16 by 17" in message, message
    assert "Traceback" not in message and "\n" not in message and "reference failed" not in message
