"""kernels.greedy: the decoder step's greedy sampler against numpy's argmax, on llvm, for CUDA (codegen here, numbers
on a GPU)."""

import numpy as np
import pytest
import tvm
from tvm import relax

from checks import cuda_sources
from tvmfuse.build import compile_module
from tvmfuse.spaces import apply_default_schedules
from tvmfuse.kernels.greedy import GREEDY, THREADS, add_greedy_tokens
from tvmfuse.targets import resolve_target
from tvmfuse.verify.outputs import cast_array


def _step(vocab, dtype: str) -> tvm.IRModule:
    """A stand-in decoder step: logits [batch, seq, vocab] out, 2 x its input (vocab None: symbolic)."""
    dims = [tvm.tirx.Var(n, "int64") for n in ("batch", "seq")] + [vocab or tvm.tirx.Var("vocab", "int64")]
    x = relax.Var("x", relax.TensorType(dims, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.add(x, x)))
    return relax.transform.LegalizeOps()(bb.get())  # as a step reaches the build: kernels called by call_tir


def _build(mod: tvm.IRModule, target):
    """Compile as the build phase does: every unscheduled kernel takes its default schedule (the sampler keeps its
    own)."""
    return compile_module(apply_default_schedules(add_greedy_tokens(mod, target), target), target)


def _logits(shape, rng) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, -1, 3] = x[0, -1, shape[2] - 2] = 25  # a tie: the lower index wins, as numpy's argmax
    x[1 % shape[0], 0, :] = -np.inf  # a row of -inf but one
    x[1 % shape[0], 0, shape[2] - 1] = -30000
    return x


def _check(vm, dev, x: np.ndarray, dtype: str) -> None:
    """The sampler over main's logits (2 x, exact) at the first and last positions against numpy's argmax of them
    (rounded to `dtype` first: rounding makes ties, which must go to the lower index too)."""
    half = cast_array(x, dtype)
    logits = vm["main"](tvm.runtime.tensor(half, dev))
    for at in (0, x.shape[1] - 1):
        got = vm[GREEDY](logits, at).numpy()
        assert got.dtype == np.int64 and got.shape == (x.shape[0], 1)
        np.testing.assert_array_equal(got[:, 0], np.asarray(half, np.float32)[:, at].argmax(-1),
                                      err_msg=f"position {at}")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("vocab", [1000, None])
def test_greedy_tokens_are_numpys_argmax_at_the_position_on_llvm(llvm, dtype, vocab):
    vm = relax.VirtualMachine(_build(_step(vocab, dtype), llvm), tvm.cpu())
    rng = np.random.default_rng(0)
    for shape in [(3, 5, 1000), (1, 1, 1000)]:
        _check(vm, tvm.cpu(), _logits(shape, rng), dtype)


@pytest.mark.parametrize("vocab", [32000, None])
def test_cuda_greedy_tokens_reduce_across_the_threads_of_one_block_per_row(vocab):
    cuda = resolve_target("cuda")
    mod = add_greedy_tokens(_step(vocab, "float16"), cuda)
    kernel = mod[GREEDY + "_argmax"]
    assert kernel.attrs["tirx.is_scheduled"]
    source = "\n".join(cuda_sources(_build(_step(vocab, "float16"), cuda)))
    assert f"__launch_bounds__({THREADS})" in source and "__shfl_down_sync" in source
    assert "blockIdx.x" in source and "blockIdx.y" not in source  # one block per row


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_greedy_tokens_are_numpys_argmax(dtype):
    cuda, dev = resolve_target("cuda"), tvm.cuda(0)
    vm = relax.VirtualMachine(_build(_step(32000, dtype), cuda), dev)
    _check(vm, dev, _logits((16, 2, 32000), np.random.default_rng(1)), dtype)
