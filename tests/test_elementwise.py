"""tvmfuse.spaces.elementwise: the vectorized default schedule for injective kernels on CUDA."""

import numpy as np
import pytest
import tvm
from checks import cuda_sources
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmfuse.spaces.defaults import VectorizedInjective, default_rule
from tvmfuse.build import compile_module
from tvmfuse.spaces import apply_default_schedules
from tvmfuse.fuse.fusion import lower
from tvmfuse.targets import resolve_target


def _concat(a_shape, b_shape, axis, transpose_b=None, dtype="float16"):
    """concat([a, permute_dims(b)?], axis): the KV-cache update of a decode step when `transpose_b` is given."""
    bb = relax.BlockBuilder()
    a, b = relax.Var("a", relax.TensorType(a_shape, dtype)), relax.Var("b", relax.TensorType(b_shape, dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            t = bb.emit(relax.op.permute_dims(b, transpose_b)) if transpose_b else b
            out = bb.emit_output(relax.op.concat([a, t], axis=axis))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _kernel(mod):
    (fn,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return fn


KV = ((4, 8, 64, 128), (4, 1, 8, 128), 2, [0, 2, 1, 3])  # past [B, H, S, D] + new [B, 1, H, D] -> [B, H, S+1, D]


@pytest.mark.parametrize("case,expected", [(KV, True), (((64, 100), (64, 28), 1, None), True),
                                           (((64, 100), (64, 27), 1, None), False),  # innermost 127: no 8-vector
                                           (((2, 4), (2, 4), 1, None), False)])  # fewer elements than one block
def test_injective_rule_takes_kernels_that_split_into_16_byte_vectors(case, expected):
    rule, _ = default_rule(_kernel(_concat(*case)), resolve_target("cuda"))
    assert isinstance(rule, VectorizedInjective) is expected, type(rule).__name__


def _compare_and_cast():
    """less(a, b) -> bool (an attention mask) and astype(a, fp16): elementwise kernels of other widths."""
    bb = relax.BlockBuilder()
    a, b = (relax.Var(n, relax.TensorType((64, 256), "float32")) for n in "ab")
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([bb.emit(relax.op.less(a, b)), bb.emit(relax.op.astype(a, "float16"))]))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def test_bool_kernels_stay_with_dlight_and_mixed_widths_use_the_widest():
    """CUDA has no vector type of bools ("Cannot convert type T.boolx16", GPT-2's mask kernels): dlight's Fallback
    takes them; a fp32 -> fp16 cast moves 4 elements (16 bytes of fp32) per access."""
    cuda = resolve_target("cuda")
    mod = _compare_and_cast()
    rules = {gv.name_hint: type(default_rule(f, cuda)[0]).__name__ for gv, f in mod.functions.items()
             if isinstance(f, tirx.PrimFunc)}
    assert sorted(rules.values()) == ["Fallback", "VectorizedInjective"], rules
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert "*(float4*)(a_ptr" in src and "*(half4*)(compute_ptr" in src  # 16-byte fp32 loads, 8-byte fp16 stores


def test_kv_concat_moves_16_bytes_per_access():
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(_concat(*KV), cuda), cuda))
    assert src.count("__global__") == 2  # one kernel
    assert src.count("*(uint4*)") == 3  # a vector load from past or new, a vector store


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("case", [KV, ((64, 100), (64, 28), 1, None), ((3, 40, 16), (3, 8, 16), 1, None)])
def test_gpu_vectorized_concat_matches_numpy(case):
    cuda, dev, rng = resolve_target("cuda"), tvm.cuda(0), np.random.default_rng(0)
    a_shape, b_shape, axis, perm = case
    a = rng.standard_normal(a_shape).astype("float16")
    b = rng.standard_normal(b_shape).astype("float16")
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(_concat(*case), cuda), cuda), dev)
    got = vm["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)).numpy()
    np.testing.assert_array_equal(got, np.concatenate([a, b.transpose(perm) if perm else b], axis=axis))


def _lookup(vocab, hidden, rows):
    """take(table, ids): an embedding lookup (int64 row ids, fp16 rows)."""
    bb = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType((vocab, hidden), "float16"))
    ids = relax.Var("ids", relax.TensorType((1, rows), "int64"))
    with bb.function("main", [table, ids]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(table, ids, axis=0))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def test_embedding_lookup_moves_whole_rows_16_bytes_at_a_time():
    """The int64 ids do not move with the innermost index: one id per 16-byte vector of the row it picks (dlight's
    Fallback moved one fp16 per thread: 9.2 µs for Llama's 512x4096 lookup on the H200, models_run17.json)."""
    cuda = resolve_target("cuda")
    rule, _ = default_rule(_kernel(_lookup(256, 4096, 512)), cuda)
    assert isinstance(rule, VectorizedInjective), type(rule).__name__
    (src,) = cuda_sources(compile_module(apply_default_schedules(_lookup(256, 4096, 512), cuda), cuda))
    assert src.count("*(uint4*)") == 2 and "ids_ptr[" in src  # a vector load of the picked row, a vector store
    rule, _ = default_rule(_first_columns_of_picked_rows, cuda)  # rows 4100 apart: vectors not 16-byte aligned
    assert not isinstance(rule, VectorizedInjective)


@pytest.mark.parametrize("vocab,hidden,rows", [(30522, 768, 16), (256, 4096, 512), (128, 72, 40)])
def test_lookup_compiles_with_one_scalar_id_per_vector(vocab, hidden, rows):
    """Rows whose length divides no block of vectors (BERT's 768: 2048 elements per block) still read one scalar
    id per vector: fusing every loop before splitting made the ids an int64x8 vector, and CUDA codegen failed
    ("type_name.empty()") for BERT decode-16 and prefill on the H200 (models_run18.json in bench/results/archive-sessions-8-9.tar.xz)."""
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(_lookup(vocab, hidden, rows), cuda), cuda))
    assert src.count("*(uint4*)") == 2 and "ids_ptr[" in src and "longlong" not in src


@T.prim_func(private=True, s_tir=True)
def _first_columns_of_picked_rows(table: T.Buffer((256, 4100), "float16"), ids: T.Buffer((512,), "int64"),
                                  out: T.Buffer((512, 4096), "float16")):
    T.func_attr({"tirx.noalias": True})
    for i, k in T.grid(512, 4096):
        with T.sblock("gather"):
            vi, vk = T.axis.remap("SS", [i, k])
            out[vi, vk] = table[ids[vi], vk]


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_vectorized_lookup_matches_numpy():
    cuda, dev, rng = resolve_target("cuda"), tvm.cuda(0), np.random.default_rng(0)
    table = rng.standard_normal((256, 4096)).astype("float16")
    ids = rng.integers(0, 256, (1, 512)).astype("int64")
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(_lookup(256, 4096, 512), cuda), cuda), dev)
    got = vm["main"](tvm.runtime.tensor(table, dev), tvm.runtime.tensor(ids, dev)).numpy()
    np.testing.assert_array_equal(got, table[ids])


def test_a_concatenation_along_a_symbolic_axis_that_fallback_raises_on_gets_a_schedule():
    """The KV concatenation of a batch-16, seq-512 bucket over the symbolic past: dlight's rules raise (TVM's
    iter-map rewrite cannot prove 32 * past + 16384 divisible when Fallback splits the fused loops; the 2-layer
    generation build failed so on the H200). The rows schedule takes it (16-byte vectors along the head dim), and
    where its rows are not whole vectors (head dim 127) the unsplit one; nvcc compiles both. A static
    concatenation keeps the vectorized schedule."""
    import shutil

    from tvm.s_tir import dlight as dl

    from tvmfuse.spaces.defaults import UnsplitInjective, VectorizedRows

    past = tirx.Var("past", "int64")
    cuda = resolve_target("cuda")
    for dim, rule_type, threads in [(128, VectorizedRows, 16), (127, UnsplitInjective, 127)]:
        mod = _concat((16, 1, past, dim), (16, 1, 512, dim), axis=2)
        fn = _kernel(mod)
        with cuda, pytest.raises(tvm.error.InternalError, match="CanProveDivisible"):
            dl.gpu.Fallback().apply(fn, cuda, False)
        rule, _ = default_rule(fn, cuda)
        assert isinstance(rule, rule_type), (dim, type(rule).__name__)
        (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
        assert f"__launch_bounds__({threads})" in src  # a row (the head dim) across the threads
        assert ("*(uint4*)" in src) is (rule_type is VectorizedRows)
        if shutil.which("nvcc"):
            with cuda:
                assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000
    static = _kernel(_concat((16, 1, 64, 128), (16, 1, 512, 128), axis=2))
    assert isinstance(default_rule(static, cuda)[0], VectorizedInjective)


def _cache_write(seq_major: bool):
    """The in-place KV cache's write (prepare.kv_cache) at Llama-2-7B's 32 heads of 128, fp16."""
    from tvmfuse.prepare.kv_cache import _write_kernel  # pylint: disable=import-outside-toplevel

    return _write_kernel(2176, 32, 128, "float16", seq_major)


@pytest.mark.parametrize("seq_major", [False, True])
def test_kv_cache_write_moves_rows_of_16_byte_vectors_one_cta_per_position(seq_major):
    """[batch, seq] symbolic over a static [heads, head dim] row of 4096: one CTA per (row, position), 512
    threads of 8 halves (Fallback: one half per thread, 64-bit divisions by seq; ~240 GB/s in the prefill)."""
    from tvmfuse.spaces.defaults import VectorizedRows  # pylint: disable=import-outside-toplevel

    cuda = resolve_target("cuda")
    func = _cache_write(seq_major)
    rule, _ = default_rule(func, cuda)
    assert isinstance(rule, VectorizedRows), type(rule).__name__
    mod = apply_default_schedules(tvm.IRModule({"write": func.with_attr("global_symbol", "write")}), cuda)
    src = tvm.compile(mod, target=cuda).mod.imports[0].inspect_source("cuda")
    assert "__launch_bounds__(512)" in src and src.count("*(uint4*)") == 2


def test_rows_rule_leaves_what_would_misalign_a_vector_or_has_no_static_row():
    """A read one element off the row's start (at a symbolic row count), an innermost symbolic axis (the decoder
    mask's keys): not the rows schedule."""
    from tvmfuse.spaces.defaults import VectorizedRows  # pylint: disable=import-outside-toplevel

    cuda = resolve_target("cuda")

    @T.prim_func(private=True, s_tir=True)
    def shifted_rows(x_h: T.handle, out_h: T.handle):
        n = T.int64()
        x = T.match_buffer(x_h, (n, 4104), "float16")
        out = T.match_buffer(out_h, (n, 4096), "float16")
        for i, k in T.grid(n, 4096):
            with T.sblock("shift"):
                vi, vk = T.axis.remap("SS", [i, k])
                out[vi, vk] = x[vi, vk + 1]  # each vector 2 bytes past a 16-byte boundary

    @T.prim_func(private=True, s_tir=True)
    def keys_innermost(x_h: T.handle, out_h: T.handle):
        n, m = T.int64(), T.int64()
        x = T.match_buffer(x_h, (n, m), "float16")
        out = T.match_buffer(out_h, (n, m), "float16")
        for i, j in T.grid(n, m):
            with T.sblock("copy"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = x[vi, vj]

    for func in (shifted_rows, keys_innermost):
        assert not isinstance(default_rule(func, cuda)[0], VectorizedRows)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_symbolic_concat_schedule_matches_numpy():
    """On a GPU: the concatenation above (the rows schedule) at past 37 against numpy."""
    past = tirx.Var("past", "int64")
    mod = _concat((16, 1, past, 128), (16, 1, 512, 128), axis=2)
    cuda = resolve_target("cuda")
    ex = compile_module(apply_default_schedules(mod, cuda), cuda)
    vm = relax.VirtualMachine(ex, tvm.cuda(0))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 1, 37, 128)).astype("float16")
    b = rng.standard_normal((16, 1, 512, 128)).astype("float16")
    got = vm["main"](tvm.runtime.tensor(a, tvm.cuda(0)), tvm.runtime.tensor(b, tvm.cuda(0))).numpy()
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=2))
