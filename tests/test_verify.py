"""Verify stage: tolerances by dtype, NaN handling, shape and count mismatches."""

import numpy as np
import pytest

from tvmfuse.verify import compare, module_inputs


def test_fp32_tolerance_is_1e4():
    want = np.zeros((4, 4), "float32")
    assert compare([want + 5e-5], [want]).ok
    check = compare([want + 5e-4], [want])
    assert not check.ok and check.max_abs_err == pytest.approx(5e-4, rel=1e-3)


def test_fp16_tolerance_is_1e2():
    want = np.zeros(8, "float16")
    assert compare([want + np.float16(5e-3)], [want]).ok
    assert not compare([want + np.float16(5e-2)], [want]).ok


def test_nan_only_where_the_reference_has_nan():
    want = np.array([1.0, np.nan], "float32")
    assert compare([want.copy()], [want]).ok
    assert not compare([np.array([np.nan, np.nan], "float32")], [want]).ok


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
