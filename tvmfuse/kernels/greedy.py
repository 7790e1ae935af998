"""The greedy sampler a decoder step's export carries: each row's argmax over the vocabulary at one position of the
step's logits, on the device, so a generation step hands the next step its token ids where they lie and copies
`batch` ids to the host instead of the logits (a [16, 32000] fp16 argmax in numpy takes ~0.8 ms, a decode step of
Llama-2-7B's 8 layers ~2.3)."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, te, tirx

GREEDY = "greedy_tokens"  # the export's Relax function: (logits [batch, seq, vocab], at) -> ids [batch, 1] int64
THREADS = 1024  # one CTA per row: 32000 logits are 32 loads a thread, in flight at once (the loop is unrolled)


def _argmax_reducer() -> te.CommReducer:
    """(index, value) of the largest value, the lowest index among equal ones (numpy's argmax): the combiner in the
    form TVM's reducer registry matches, so the cross-thread reduction lowers to warp shuffles."""

    def combine(x, y):
        take_x = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(take_x, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(index_dtype, value_dtype):
        return tirx.const(-1, index_dtype), tvm.tirx.min_value(value_dtype)

    return te.comm_reducer(combine, identity, name="argmax")


def greedy_tokens_kernel(dtype: str, vocab: int | None, gpu: bool) -> tirx.PrimFunc:
    """tokens[b, 0] = argmax_k logits[b, at, k] for logits [batch, seq, vocab] of `dtype` (`vocab` None: symbolic);
    on a GPU one CTA of THREADS threads per row, else plain loops."""
    batch, seq = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    width = tirx.IntImm("int64", vocab) if vocab is not None else tirx.Var("vocab", "int64")
    logits = te.placeholder((batch, seq, width), dtype, name="logits")
    at = tirx.Var("at", "int64")
    k = te.reduce_axis((0, width), name="k")
    index, _ = te.compute((batch, 1), lambda b, _: _argmax_reducer()((k.var.astype("int64"), logits[b, at, k]), axis=k),
                          name="argmax")
    tokens = te.compute((batch, 1), lambda b, j: index[b, j], name="tokens")
    func = te.create_prim_func([logits, at, tokens]).without_attr("global_symbol")  # named where it is added
    if not gpu:
        return func
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("argmax")
    row, one, reduce = sch.get_loops(block)
    row = sch.fuse(row, one)
    serial, lane = sch.split(reduce, [None, THREADS])
    sch.bind(row, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    sch.annotate(serial, "pragma_auto_unroll_max_step", 64)
    sch.annotate(serial, "pragma_unroll_explicit", 1)
    for buffer in range(2):  # the running (index, value) in registers: TVM reduces local buffers across threads
        sch.set_scope(block, buffer, "local")
    sch.reverse_compute_at(sch.get_sblock("tokens"), row)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def add_greedy_tokens(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """`mod` with the Relax function GREEDY over the logits `main` returns first ([batch, seq, vocab])."""
    ret = mod["main"].ret_ty
    logits_ty = ret.fields[0] if isinstance(ret, relax.TupleType) else ret
    dims = list(logits_ty.shape.values)
    vocab = int(dims[-1]) if isinstance(dims[-1], tirx.IntImm) else None
    dtype = str(logits_ty.dtype)
    batch, seq = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    width = vocab if vocab is not None else tirx.Var("vocab", "int64")
    logits = relax.Var("logits", relax.TensorType([batch, seq, width], dtype))
    at = relax.Var("at", tvm.ir.PrimType("int64"))
    bb = relax.BlockBuilder(mod)
    kernel = bb.add_func(greedy_tokens_kernel(dtype, vocab, "gpu" in target.keys), GREEDY + "_argmax")
    with bb.function(GREEDY, [logits, at], attrs={"global_symbol": GREEDY}):
        tokens = bb.emit(relax.call_tir(kernel, relax.Tuple([logits, at]), relax.TensorType([batch, 1], "int64")))
        bb.emit_func_output(tokens)
    return bb.get()
