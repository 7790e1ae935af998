"""Legalization overrides: integer powers as products, last-axis concatenations that CUDA can vectorize."""

import re

import numpy as np
import onnx
import pytest
import tvm
from checks import check_against_ort, cuda_sources, lower_model
from onnx import TensorProto, helper
from tvm import relax

from tvmfuse.fuse import fusion as fuse
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.targets import resolve_target


def _power_module(exponent: float, dtype: str = "float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 32), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.power(x, relax.const(exponent, dtype)))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _kernel_source(mod) -> str:
    return "\n".join(str(f) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_integer_power_is_a_product(exponent):
    mod = _power_module(exponent)
    assert "pow(" not in _kernel_source(mod)
    x = np.linspace(-3, 3, 128, dtype="float32").reshape(4, 32)
    got = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x ** exponent, rtol=1e-6)


def test_other_powers_keep_tvm_pow():
    assert "pow(" in _kernel_source(_power_module(0.5))


def test_cuda_source_has_no_powf_for_the_gelu_cube():
    """The CUDA kernel multiplies (CUDA builds use --use_fast_math: powf(x<0, 3) would be NaN)."""
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules

    target = resolve_target("cuda")
    mod = apply_default_schedules(_power_module(3.0, "float16"), target)
    src = compile_module(mod, target).jit().imports[0].inspect_source()
    assert "hpow" not in src.split("main_kernel", 1)[-1] and "powf" not in src.split("main_kernel", 1)[-1]


def test_power_with_a_parameter_exponent_is_right_for_negative_bases():
    """Inside a fused composite the exponent is a parameter, not a constant: pow(|x|, y) with the sign restored
    for odd integer y (CUDA's fast-math powf of a negative base is NaN)."""
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType((4, 32), "float32")), relax.Var("y", relax.TensorType((), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.power(x, y))
        bb.emit_func_output(out)
    mod = lower(bb.get(), patterns=[]).mod
    assert "fabs" in _kernel_source(mod) or "abs(" in _kernel_source(mod)
    xs = np.linspace(-3, 3, 128, dtype="float32").reshape(4, 32)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for exponent in (2.0, 3.0, 0.5):
        got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(np.array(exponent, "float32"))).numpy()
        want = xs ** exponent if exponent != 0.5 else np.abs(xs) ** 0.5
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _concat_module(widths, dtype="float32", outer=(2, 3)):
    """concat of parts [*outer, w] on the last axis."""
    bb = relax.BlockBuilder()
    parts = [relax.Var(f"p{i}", relax.TensorType((*outer, w), dtype)) for i, w in enumerate(widths)]
    with bb.function("main", parts):
        with bb.dataflow():
            out = bb.emit_output(relax.op.concat(parts, axis=-1))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _rotate_half_module(shape, dtype="float32", with_rope=False):
    """concat(-x[..., d/2:], x[..., :d/2], axis=-1) (Llama's rotate_half), and with `with_rope` x*cos + that*sin."""
    bb = relax.BlockBuilder()
    x, cos, sin = (relax.Var(n, relax.TensorType(shape, dtype)) for n in ("x", "cos", "sin"))
    half, d = shape[-1] // 2, shape[-1]
    with bb.function("main", [x, cos, sin] if with_rope else [x]):
        with bb.dataflow():
            hi = bb.emit(relax.op.negative(relax.op.strided_slice(x, [len(shape) - 1], [half], [d])))
            rot = bb.emit(relax.op.concat([hi, relax.op.strided_slice(x, [len(shape) - 1], [0], [half])], axis=-1))
            if with_rope:
                rot = relax.op.add(relax.op.multiply(x, cos), relax.op.multiply(rot, sin))
            out = bb.emit_output(rot)
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _picks_by_start(mod) -> bool:
    """TVM's own concat legalization: `T.if_then_else(start <= j, ...)` (ours: `j < end`)."""
    return re.search(r"if_then_else\(T\.int64\(\d+\) <= ", _kernel_source(mod)) is not None


def _run_llvm(mod, *arrays):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


@pytest.mark.parametrize("widths,dtype,ours", [
    ((8, 4, 12), "float32", True),     # g = 4 fp32 lanes: every width a multiple
    ((16, 0, 8, 24), "float16", True),  # g = 8 fp16 lanes; a zero-width part
    ((8, 5), "float32", False),         # 5 is not a multiple of 4: TVM's legalization
    ((12, 4), "float16", False),        # 12 is not a multiple of 8
])
def test_last_axis_concat_is_exact(widths, dtype, ours):
    mod = _concat_module(widths, dtype)
    assert _picks_by_start(mod) is not ours
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((2, 3, w)).astype(dtype) for w in widths]
    np.testing.assert_array_equal(_run_llvm(mod, *parts), np.concatenate(parts, axis=-1))


def test_other_axes_keep_tvm_concat():
    bb = relax.BlockBuilder()
    a, b = relax.Var("a", relax.TensorType((8, 16), "float32")), relax.Var("b", relax.TensorType((8, 16), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.concat([a, b], axis=0))
        bb.emit_func_output(out)
    mod = lower(bb.get(), patterns=[]).mod
    assert _picks_by_start(mod)
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 16), "float32")
    np.testing.assert_array_equal(_run_llvm(mod, x, y), np.concatenate([x, y]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rotate_half_is_exact(dtype):
    mod = _rotate_half_module((2, 3, 4, 32), dtype)
    assert not _picks_by_start(mod)
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 32)).astype(dtype)
    np.testing.assert_array_equal(_run_llvm(mod, x), np.concatenate([-x[..., 16:], x[..., :16]], axis=-1))


def test_onnx_rotary_embedding_matches_numpy():
    """The ONNX rotary embedding (Slice, Neg, Concat, Mul, Add) with the whole pattern table: the concat inside the
    fused rotary kernel is ours too."""
    n = helper.make_node
    i64 = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [1], [v])  # noqa: E731
    nodes = [n("Slice", ["x", "mid", "end", "ax"], ["hi"]), n("Neg", ["hi"], ["nhi"]),
             n("Slice", ["x", "zero", "mid", "ax"], ["lo"]), n("Concat", ["nhi", "lo"], ["rot"], axis=-1),
             n("Mul", ["x", "cos"], ["xc"]), n("Mul", ["rot", "sin"], ["rs"]), n("Add", ["xc", "rs"], ["y"])]
    shape = [1, 2, 8, 32]
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info(v, TensorProto.FLOAT, s) for v, s in
                                              (("x", shape), ("cos", shape[2:]), ("sin", shape[2:]))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [i64("mid", 16), i64("end", 32), i64("zero", 0), i64("ax", -1)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.checker.check_model(model)
    imp = import_model(model, {})
    mod = lower(imp.mod, imp.params).mod
    assert not _picks_by_start(mod)
    rng = np.random.default_rng(2)
    x, cos, sin = (rng.standard_normal(s).astype("float32") for s in (shape, shape[2:], shape[2:]))
    want = x * cos + np.concatenate([-x[..., 16:], x[..., :16]], axis=-1) * sin
    np.testing.assert_allclose(_run_llvm(mod, x, cos, sin), want, rtol=1e-6, atol=1e-6)


def _rope_cuda_source(mod) -> str:
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules

    target = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, target), target))
    return src


def test_cuda_rope_moves_16_byte_vectors(monkeypatch):
    """The fused rope kernel (slices, negative, concat, multiply, add; fp16, d = 128) picks the concat part once per
    8-lane vector: 16-byte loads of x (both halves) and a 16-byte store, no loop over the lanes. TVM's own
    legalization (`64 <= j`) ran the lanes as a loop of 2-byte accesses."""
    mod = _rotate_half_module((1, 4, 64, 128), "float16", with_rope=True)
    src = _rope_cuda_source(mod)
    assert src.count("__global__") == 2  # one kernel
    assert src.count("*(uint4*)(x_ptr") == 3  # x, x[j + 64] for the negated half, x[j - 64]
    assert "*(uint4*)(T_add_intermediate_ptr" in src
    assert not re.search(r"for \(int \w+_s = 0; \w+_s < 8;", src)

    monkeypatch.setattr(fuse, "LEGALIZE", {k: v for k, v in fuse.LEGALIZE.items() if k != "relax.concat"})
    stock = _rope_cuda_source(_rotate_half_module((1, 4, 64, 128), "float16", with_rope=True))
    assert re.search(r"for \(int \w+_s = 0; \w+_s < 8;", stock) and "uint4" not in stock


def test_cuda_three_part_fp32_concat_moves_16_byte_vectors():
    src = _rope_cuda_source(_concat_module((32, 64, 32), "float32", outer=(64,)))
    assert src.count("*(float4*)(p") == 3 and "*(float4*)(T_concat" in src
    assert not re.search(r"for \(int \w+_s = 0; \w+_s < 4;", src)


def _split_attention(leak: str | None = None, b=2, s=8, h=4, d=16, dyn=False) -> onnx.ModelProto:
    """GPT-2's attention input: one QKV tensor [B, S, 3*H*D] split in three, each part reshaped to heads and
    permuted to [B, H, S, D], then softmax(q k^T * scale) v. `leak`: "k" also a model output, "k+1" k plus one as
    an output (read by an add too); `dyn`: batch and sequence symbolic."""
    b, s = ("batch", "seq") if dyn else (b, s)
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Split", ["qkv", "parts"], ["q0", "k0", "v0"], axis=-1)]
    for t in "qkv":
        nodes += [helper.make_node("Reshape", [f"{t}0", "heads"], [f"{t}1"]),
                  helper.make_node("Transpose", [f"{t}1"], [t], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), helper.make_node("MatMul", ["q", "kt"], ["sc"]),
              helper.make_node("Mul", ["sc", "scale"], ["ss"]), helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"])]
    outs = [helper.make_tensor_value_info("y", f32, [b, h, s, d])]
    if leak == "k":
        outs.append(helper.make_tensor_value_info("k0", f32, [b, s, h * d]))
    elif leak == "k+1":
        nodes.append(helper.make_node("Add", ["k0", "scale"], ["k_plus"]))
        outs.append(helper.make_tensor_value_info("k_plus", f32, [b, s, h * d]))
    inits = [helper.make_tensor("parts", TensorProto.INT64, [3], [h * d] * 3),
             helper.make_tensor("heads", TensorProto.INT64, [4], [0, 0, h, d]),
             helper.make_tensor("scale", f32, [], [d ** -0.5])]
    graph = helper.make_graph(nodes, "split_attention", [helper.make_tensor_value_info("qkv", f32, [b, s, 3 * h * d])],
                              outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _split_nests(fused) -> list[dict[str, int]]:
    """Per split kernel: {split block name: id of the loop nest it is in} (one id per nest)."""
    found = []
    for gv, fn in fused.mod.functions.items():
        if isinstance(fn, tvm.tirx.PrimFunc) and "split" in gv.name_hint:
            sch = tvm.s_tir.Schedule(fn)
            nests: dict = {}
            for rv in sch.get_child_blocks(sch.get_sblock("root")):
                name = sch.get(rv).name_hint
                if name.startswith("T_split"):
                    outer = sch.get(sch.get_loops(rv)[0])
                    key = next((k for k in nests if k.same_as(outer)), outer)
                    nests.setdefault(key, []).append(name)
            found.append({n: i for i, names in enumerate(nests.values()) for n in names})
    return found


@pytest.mark.parametrize("leak", [None, "k", "k+1"])
@pytest.mark.parametrize("dyn", [False, True])
def test_split_feeding_a_fused_group_is_one_kernel(dyn, leak, llvm):
    """The parts feed the attention group (through the head reshape), one of them maybe a model output or read by
    an add as well: FuseOps leaves such a split alone either way, and one loop nest writes the three parts (one
    kernel; TVM's split is a loop nest per part). The result equals onnxruntime's, symbolic dims too."""
    model = _split_attention(leak, dyn=dyn)
    imp, fused = lower_model(model)
    assert "tvmfuse.attention" in fused.kernel_patterns.values(), fused.rejections
    assert _split_nests(fused) == [{"T_split_v0": 0, "T_split_v1": 0, "T_split_v2": 0}]
    result = check_against_ort(model, imp, fused, llvm)
    assert result.ok and result.max_abs_err < 1e-5, result


def _split_attention_relax(b=2, s=8, h=4, d=16, heads_first=True) -> tvm.IRModule:
    """In Relax (onnxruntime's clean-up of an ONNX graph this small moves a permute past the split): GPT-NeoX's
    [B, S, 3*H*D] reshaped to [B, S, H, 3*D], permuted to [B, H, S, 3*D] and split in three on the last axis; or (not
    `heads_first`) GPT-2's [B*S, 3*H*D] reshaped to [B, S, 3*H*D], split, each part reshaped to heads and permuted;
    then softmax(q k^T / sqrt(d)) v."""
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((b, s, 3 * h * d) if heads_first else (b * s, 3 * h * d), "float32"))
    with bb.function("main", [qkv]):
        with bb.dataflow():
            if heads_first:
                heads = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(qkv, (b, s, h, 3 * d))), [0, 2, 1, 3]))
                parts = bb.emit(relax.op.split(heads, 3, axis=-1))
                q, k, v = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(3))
            else:
                parts = bb.emit(relax.op.split(bb.emit(relax.op.reshape(qkv, (b, s, 3 * h * d))), 3, axis=-1))
                q, k, v = (bb.emit(relax.op.permute_dims(relax.op.reshape(relax.TupleGetItem(parts, i), (b, s, h, d)),
                                                         [0, 2, 1, 3])) for i in range(3))
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])),
                                               relax.const(d ** -0.5, "float32")))
            out = bb.emit_output(relax.op.matmul(relax.op.nn.softmax(scores, axis=-1), v))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("heads_first", [True, False])
def test_a_one_kernel_split_takes_the_permute_before_it_and_no_reshape(heads_first, llvm):
    """After a head permute (GPT-NeoX's), FuseOps fuses the permute into the one-kernel split (it was a transpose
    kernel of its own); after a reshape (GPT-2's [B*S, W] -> [B, S, W]) the split is opaque to it: the reshape stays
    a view, so the attention can read the split's input in place (`kernels/split_reads.py`). Two launches either way,
    the split and the attention, equal to numpy."""
    fused = lower(_split_attention_relax(heads_first=heads_first))
    assert "tvmfuse.attention" in fused.kernel_patterns.values(), fused.rejections
    (split,) = [k for k in fused.kernels() if "split" in k]
    assert "transpose" in split if heads_first else split == "split", fused.kernels()  # (NeoX's reshape in it too)
    assert fused.launches() == 2, fused.kernels()
    x = np.random.default_rng(0).standard_normal((2, 8, 3 * 64)).astype("float32")
    got = relax.VirtualMachine(tvm.compile(fused.mod, target=llvm), tvm.cpu())["main"](
        tvm.runtime.tensor(x if heads_first else x.reshape(16, 192))).numpy()
    q, k, v = (np.split(x.reshape(2, 8, 4, 48), 3, axis=-1) if heads_first
               else [p.reshape(2, 8, 4, 16) for p in np.split(x, 3, axis=-1)])
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    p = np.exp(q @ k.transpose(0, 1, 3, 2) / 4.0)
    np.testing.assert_allclose(got, p / p.sum(-1, keepdims=True) @ v, rtol=1e-5, atol=1e-5)


def test_split_read_by_elementwise_ops_only_keeps_tvm_split(llvm):
    """q + k * v from one split: FuseOps fuses TVM's split into the elementwise kernel (its blocks inlined, no
    part written to memory), so it stays TVM's."""
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1, num_outputs=3),
             helper.make_node("Mul", ["k", "v"], ["kv"]), helper.make_node("Add", ["q", "kv"], ["y"])]
    graph = helper.make_graph(nodes, "split_elementwise", [helper.make_tensor_value_info("qkv", f32, [2, 8, 48])],
                              [helper.make_tensor_value_info("y", f32, [2, 8, 16])], [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    imp, fused = lower_model(model)
    assert len(fused.kernels()) == 1 and "split" in fused.kernels()[0], fused.kernels()
    nests = _split_nests(fused)
    assert len(nests) == 1 and sorted(nests[0].values()) == [0, 1, 2], nests  # TVM's: a loop nest per part
    assert check_against_ort(model, imp, fused, llvm).ok


def test_cuda_one_kernel_split_moves_16_byte_vectors():
    """On CUDA the three parts are written by one kernel with 16-byte loads and stores (the injective schedule
    takes a loop nest of several blocks)."""
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules

    target = resolve_target("cuda")
    _, fused = lower_model(_split_attention(b=2, s=64, h=4, d=16), None)
    mod = apply_default_schedules(fused.mod, target)
    src = "".join(cuda_sources(compile_module(mod, target)))
    kernels = re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w*split\w*)\(", src)
    assert len(set(kernels)) == 1, kernels
    body = src.split(f"{kernels[0]}(", 2)[-1].split("\n}", 1)[0]
    assert len(re.findall(r"\*\((?:float4|uint4)\*\)", body)) == 6, body  # three 16-byte loads, three stores
