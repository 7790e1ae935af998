"""The cost model against hand-computed bytes, FLOPs and roofline latencies."""

from __future__ import annotations

import pytest
from tvm import relax, tirx
from tvm.script import relax as R

from tvmfuse.decide import cost_model as cm


def _bindings(func):
    return {b.var.name: b for b in func.body.blocks[0].bindings}


@R.function
def _ops(x: R.Tensor((128, 256), "float32"), w: R.Tensor((256, 512), "float32"), b: R.Tensor((512,), "float32"),
         g: R.Tensor((512,), "float32")):
    with R.dataflow():
        mm = R.matmul(x, w)
        ad = R.add(mm, b)
        sm = R.nn.softmax(ad, axis=-1)
        ln = R.nn.layer_norm(sm, g, g, axes=[-1])
        rs = R.reshape(ln, R.shape([64, 1024]))
        R.output(rs)
    return rs


def _cost(name):
    b = _bindings(_ops)[name]
    return cm.op_cost(b.value, b.var.ty, cm.Dims())


def test_matmul_bytes_and_flops():
    c = _cost("mm")
    assert c.bytes_read == (128 * 256 + 256 * 512) * 4
    assert c.bytes_written == 128 * 512 * 4
    assert c.flops == 2 * 128 * 512 * 256
    assert c.launches == 1


def test_broadcast_add_reads_the_bias_once():
    c = _cost("ad")
    assert (c.bytes_read, c.bytes_written, c.flops) == ((128 * 512 + 512) * 4, 128 * 512 * 4, 128 * 512)


def test_softmax_and_layer_norm_flops():
    assert _cost("sm").flops == 5 * 128 * 512
    ln = _cost("ln")
    assert ln.flops == 8 * 128 * 512 and ln.bytes_read == (128 * 512 + 2 * 512) * 4


def test_reshape_is_a_free_view():
    assert _cost("rs") == cm.Cost()


def test_roofline_latency_memory_and_compute_bound():
    dev = cm.Device("test", 1e12, {"float32": 1e13}, 2.0, 255, 65536, 48 * 1024, 48 * 1024)
    mem = cm.Cost(bytes_read=3_000_000, bytes_written=1_000_000, flops=1000, launches=1)
    assert mem.latency_us(dev) == pytest.approx(4.0 + 2.0)      # 4 MB at 1 TB/s = 4 us, + 1 launch
    comp = cm.Cost(bytes_read=1000, flops=10**8, launches=2)
    assert comp.latency_us(dev) == pytest.approx(10.0 + 4.0)    # 1e8 FLOP at 1e13 FLOP/s = 10 us
    assert comp.intensity == pytest.approx(1e5)


def test_symbolic_dims_take_assumed_values():
    n, s = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    dims = cm.Dims({"batch": 2}, default=128)
    ty = relax.TensorType([n * s, 64], "float16")
    assert dims.nbytes(ty) == 2 * 128 * 64 * 2
    assert dims.value("batch * seq") == 256 and dims.used == {"batch": 2, "seq": 128}


def test_device_table_has_gpus_and_host():
    assert {"h100", "h200", "cpu"} <= set(cm.DEVICES)
    assert cm.DEVICES["h200"].bandwidth > cm.DEVICES["h100"].bandwidth > cm.DEVICES["cpu"].bandwidth
    assert cm.device_for_target(None).name.startswith("host CPU")


def test_symbolic_dim_with_a_constant_evaluates():
    """A bucket binds seq = 1 in past + seq: the dim's text is "past + 1" (not "past + T.int64(1)", which the
    cost model could not evaluate: every --buckets build of a KV cache step failed in decide)."""
    import tvm

    from tvmfuse.decide.cost_model import Dims
    from tvmfuse.patterns.readers import dim_str

    past = tvm.tirx.Var("past", "int64")
    text = dim_str(past + tvm.tirx.IntImm("int64", 1))
    assert text == "past + 1" and Dims({"past": 7}).value(text) == 8
