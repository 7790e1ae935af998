"""build.launch_order: the launches a CUDA graph cannot capture (they read an input, or have a symbolic size) move
together: those that read nothing the block computes to its top, the others to just before their first user; the
others keep their order, and every binding still follows what it reads."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from tvmfuse.build.launch_order import check_uncapturable, order_block, order_launches


@T.prim_func(s_tir=True)
def copy4(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("b"):
            vi = T.axis.remap("S", [i])
            b[vi] = a[vi] + T.float32(1)


@T.prim_func(s_tir=True)
def write(cache: T.Buffer((8,), "float32"), new: T.Buffer((4,), "float32"), pos: T.int64):
    for i in range(4):
        with T.sblock("w"):
            vi = T.axis.remap("S", [i])
            cache[pos + vi] = new[vi]


def _params():
    """x [4], past_len (a shape of the symbolic `past`) and cache [8]: the step's inputs."""
    past = tvm.tirx.Var("past", "int64")
    return (relax.Var("x", relax.TensorType([4], "float32")), relax.Var("past_len", relax.ShapeType([past])),
            relax.Var("cache", relax.TensorType([8], "float32")), past)


def _step():
    """a (static) -> w = write(cache, a, past) -> b (static, reads a) -> v = view of w (its dtype lv, a host
    builtin) -> lv1 = slice of v -> c = lv1 + m -> d (static); m = copy of input x (reads an input, nothing the
    block computes)."""
    bb = relax.BlockBuilder()
    x, past_len, cache, past = _params()
    with bb.function("main", [x, past_len, cache]):
        cp = bb.add_func(copy4, "copy4")
        wr = bb.add_func(write, "write")
        with bb.dataflow():
            a = bb.emit(relax.call_tir(cp, [relax.const(np.ones(4, "float32"))], relax.TensorType([4], "float32")),
                        "a")
            w = bb.emit(relax.op.call_tir_inplace(wr, relax.Tuple([cache, a, relax.prim_value(past)]), [0],
                                                  cache.ty), "w")
            b = bb.emit(relax.call_tir(cp, [a], relax.TensorType([4], "float32")), "b")
            v = bb.emit(relax.op.memory.view(w, relax.ShapeExpr([past + 4])), "v")
            m = bb.emit(relax.call_tir(cp, [x], relax.TensorType([4], "float32")), "m")
            c = bb.emit(relax.op.add(relax.op.strided_slice(v, [0], [0], [4]), m), "c")
            d = bb.emit_output(bb.emit(relax.call_tir(cp, [c], relax.TensorType([4], "float32")), "d"))
        bb.emit_func_output(d)
    mod = bb.get()
    return mod, {x, past_len, cache}


def _names(bindings) -> list[str]:
    return [b.var.name for b in bindings]


def test_uncapturable_bindings_move_together_and_the_rest_keep_their_order():
    mod, inputs = _step()
    bindings = list(mod["main"].body.blocks[0].bindings)
    assert _names(bindings) == ["a", "w", "b", "lv", "v", "m", "lv1", "c", "d", "gv"]
    assert [check_uncapturable(b, inputs) for b in bindings] == [False, True, False, False, True, True, True, False,
                                                                  False, False]
    # m reads only an input and lv (read by the view alone) nothing: first; w, v and lv1 just before c, the first
    # binding that uses them; a, b, c, d as they were
    assert _names(order_block(bindings, inputs)) == ["lv", "m", "a", "b", "w", "v", "lv1", "c", "d", "gv"]


def test_a_capturable_binding_between_uncapturable_ones_does_not_move():
    """The negative: b reads a (a launch of its own), so nothing pulls it next to w or past it."""
    mod, inputs = _step()
    order = _names(order_block(list(mod["main"].body.blocks[0].bindings), inputs))
    assert order.index("a") < order.index("b") < order.index("w")


def test_the_ordered_module_computes_the_same():
    mod, _ = _step()
    ordered = order_launches(mod)
    assert _names(ordered["main"].body.blocks[0].bindings) == ["lv", "m", "a", "b", "w", "v", "lv1", "c", "d", "gv"]
    results = []
    for m in (mod, ordered):
        legal = relax.transform.LegalizeOps()(m)
        vm = relax.VirtualMachine(tvm.compile(legal, target="llvm"), tvm.cpu())
        cache = tvm.runtime.tensor(np.zeros(8, "float32"))
        out = vm["main"](tvm.runtime.tensor(np.arange(4, dtype="float32")), tvm.runtime.ShapeTuple([2]), cache)
        results.append((out.numpy(), cache.numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(results[1][1], [0, 0, 2, 2, 2, 2, 0, 0])


def test_an_in_place_write_of_an_input_is_not_hoisted_above_a_read_of_it():
    """The negative for hoisting: w overwrites the input `cache` from inputs alone, r (a launch before it) reads the
    cache; w may not move above r, and it stays after it."""
    bb = relax.BlockBuilder()
    x, past_len, cache, past = _params()
    with bb.function("main", [x, past_len, cache]):
        cp, wr = bb.add_func(copy4, "copy4"), bb.add_func(write, "write")
        with bb.dataflow():
            r = bb.emit(relax.call_tir(cp, [relax.op.strided_slice(cache, [0], [0], [4])],
                                       relax.TensorType([4], "float32")), "r")
            w = bb.emit(relax.op.call_tir_inplace(wr, relax.Tuple([cache, x, relax.prim_value(past)]), [0], cache.ty),
                        "w")
            out = bb.emit_output(bb.emit(relax.op.add(relax.op.strided_slice(w, [0], [0], [4]), r), "out"))
        bb.emit_func_output(out)
    bindings = list(bb.get()["main"].body.blocks[0].bindings)
    order = _names(order_block(bindings, {x, past_len, cache}))
    assert order.index("r") < order.index("w"), order
