"""fp32 arithmetic inside fp16/bf16 kernels: the rotary embedding's group, matmul epilogues on the fp32 sums, and the exact value of rounded scalars."""

from __future__ import annotations

import shutil
import sys

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

from tvmfuse.fuse.fusion import lower
from tvmfuse.kernels.substitution import template_sites
from tvmfuse.prepare.opmath import EXACT_SCALARS, exact_scalar
from tvmfuse.patterns import fusion_patterns
from tvmfuse.prepare.precision import to_compute_dtype

S, H, D = 16, 2, 32


def _rope_module(dtype: str, extra_use: bool = False, permute: tuple = (), shape: tuple | None = None,
                 rot_permuted: bool = True) -> tvm.IRModule:
    """y = x * cos + concat(-x[..., D/2:], x[..., :D/2]) * sin on x [1, S, H, D], cos/sin [1, S, 1, D] inputs;
    `extra_use`: the rotated half is also an output (the group must not take it). `permute`: the axes of the
    head permute as TVM imports Llama's Q, permute(x * cos) + rotate_half(permute(x)) * sin (not
    `rot_permuted`: permute(x * cos) + rotate_half(x) * sin, the permute on one side only, for S == H)."""
    bb, shape = relax.BlockBuilder(), shape or (1, S, H, D)
    x = relax.Var("x", relax.TensorType(shape, dtype))
    cos = relax.Var("cos", relax.TensorType((1, shape[1], 1, shape[3]), dtype))
    sin = relax.Var("sin", relax.TensorType((1, 1, shape[1], shape[3]) if permute else cos.ty.shape, dtype))
    d = shape[3]
    with bb.function("main", [x, cos, sin]):
        with bb.dataflow():
            src = bb.emit(relax.op.permute_dims(x, list(permute))) if permute and rot_permuted else x
            hi = bb.emit(relax.op.strided_slice(src, [3], [d // 2], [d], [1]))
            lo = bb.emit(relax.op.strided_slice(src, [3], [0], [d // 2], [1]))
            rot = bb.emit(relax.op.concat([bb.emit(relax.op.negative(hi)), lo], axis=3))
            xc = bb.emit(relax.op.multiply(x, cos))
            xc = bb.emit(relax.op.permute_dims(xc, list(permute))) if permute else xc
            y = bb.emit(relax.op.add(xc, bb.emit(relax.op.multiply(rot, sin))))
            out = bb.emit_output(relax.Tuple([y, rot]) if extra_use else y)
        bb.emit_func_output(out)
    return bb.get()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, S, H, D)) * 3).astype("float16")
    ang = rng.uniform(0, 6.3, (1, S, 1, D))
    return x, np.cos(ang).astype("float16"), np.sin(ang).astype("float16")


def _rope(x, cos, sin):
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
    return x * cos + rot * sin


def test_rotary_group_computes_in_fp32_and_rounds_once(llvm):
    """The rotary kernel's result is the fp32 rope of its fp16 inputs rounded to fp16 once; op by op in fp16
    (what the group computed before) differs from that at many elements."""
    fused = lower(_rope_module("float16"), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    (kernel,) = fused.kernels()
    assert "float32" in fused.mod[kernel].script()  # the casts up inside the fp16 kernel
    x, cos, sin = _inputs()
    got = relax.VirtualMachine(tvm.compile(fused.mod, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (x, cos, sin)]).numpy()
    assert got.dtype == np.float16
    once = _rope(x.astype("f4"), cos.astype("f4"), sin.astype("f4")).astype("float16")
    by_op = _rope(x, cos, sin)  # numpy float16 arithmetic rounds every product and the sum
    ulp = np.abs(got.astype("f8") - once.astype("f8")) / np.spacing(np.abs(once).astype("float16")).astype("f8")
    assert ulp.max() <= 1 and (got == once).mean() > 0.99  # 1 ulp: the fp32 sum may be contracted to an FMA
    assert (by_op != once).mean() > 0.05


def test_rotary_group_takes_the_head_permute_of_llamas_q(llvm):
    """permute(x * cos) + rotate_half(permute(x)) * sin, one [0, 2, 1, 3] on both sides: one kernel that reads
    x [B,S,H,D] and writes [B,H,S,D], in fp32 inside; a permute on one side only is rejected with a reason."""
    fused = lower(_rope_module("float16", permute=(0, 2, 1, 3)), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    assert len(fused.kernels()) == 1
    x, cos, sin = _inputs()
    sin_h = np.transpose(sin, (0, 2, 1, 3))
    got = relax.VirtualMachine(tvm.compile(fused.mod, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (x, cos, sin_h)]).numpy()
    xh = np.transpose(x, (0, 2, 1, 3)).astype("f4")
    once = _rope(xh, np.transpose(cos, (0, 2, 1, 3)).astype("f4"), sin_h.astype("f4")).astype("float16")
    assert got.shape == (1, H, S, D) and np.abs(got.astype("f4") - once.astype("f4")).max() <= np.abs(once).max() * 1e-3
    one_side = _rope_module("float16", permute=(0, 2, 1, 3), shape=(1, 4, 4, D), rot_permuted=False)
    fused = lower(one_side, patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert "tvmfuse.rotary_embedding" not in fused.kernel_patterns.values()
    assert any("one side" in why for p, _, why in fused.rejections if p == "tvmfuse.rotary_embedding"), fused.rejections


def test_rotary_intermediate_used_elsewhere_is_not_fused_nor_widened():
    fused = lower(_rope_module("float16", extra_use=True), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert "tvmfuse.rotary_embedding" not in fused.kernel_patterns.values()


def test_fp32_rotary_group_is_unchanged():
    """An fp32 group has nothing to widen: no cast in its kernel."""
    fused = lower(_rope_module("float32"), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    (kernel,) = fused.kernels()
    assert "float16" not in fused.mod[kernel].script() and "T.Cast" not in fused.mod[kernel].script()


def _scaled(values: list[float]) -> tvm.IRModule:
    """main(x) = x * c0 * c1 * ... in fp32, the c scalar constants."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for v in values:
                y = bb.emit(relax.op.multiply(y, relax.const(v, "float32")))
            out = bb.emit_output(relax.op.matmul(y, relax.const(np.ones((8, 8), "float32"))))
        bb.emit_func_output(out)
    return bb.get()


def test_rounded_scalars_keep_their_fp32_values():
    """fp16 rounds 128**-0.25 (0.2973018) to 0.29736328; the module records the value it came from. 0.5 is exact
    (not recorded); two fp32 values rounding to the same fp16 value are ambiguous (left out)."""
    c = float(np.float32(128 ** -0.25))
    mod = to_compute_dtype(_scaled([c, 0.5]), "fp16")
    low = float(np.float16(c))
    assert low != c and exact_scalar(mod, low) == c and exact_scalar(mod, 0.5) == 0.5
    assert dict(mod.attrs[EXACT_SCALARS]) == {repr(low): pytest.approx(c, rel=1e-7)}
    twin = float(np.float32(c + 1e-6))  # rounds to the same fp16 value
    assert np.float16(twin) == np.float16(c)
    mod = to_compute_dtype(_scaled([c, twin]), "fp16")
    assert exact_scalar(mod, low) == low
    assert to_compute_dtype(_scaled([c]), "fp32").attrs is None or EXACT_SCALARS not in to_compute_dtype(
        _scaled([c]), "fp32").attrs


def _attention(head_dim: int) -> tvm.IRModule:
    """softmax(Q c @ (K c)^T) @ V in fp32 on [1, 64, 2, head_dim] BSHD inputs, c = head_dim**-0.25 (the sdpa export's
    split scale)."""
    bb, shape = relax.BlockBuilder(), (1, 64, 2, head_dim)
    q, k, v = (relax.Var(n, relax.TensorType(shape, "float32")) for n in "qkv")
    c = relax.const(float(np.float32(head_dim ** -0.25)), "float32")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            qh = bb.emit(relax.op.multiply(bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3])), c))
            kt = bb.emit(relax.op.multiply(bb.emit(relax.op.permute_dims(k, [0, 2, 3, 1])), c))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(qh, kt)), axis=-1))
            o = bb.emit_output(relax.op.matmul(p, bb.emit(relax.op.permute_dims(v, [0, 2, 1, 3]))))
        bb.emit_func_output(o)
    return bb.get()


def test_attention_template_scales_by_the_models_exact_value():
    """Q and K^T each times 128**-0.25 in an fp32 model converted to fp16 (fp16 interface: with an fp32 one the
    group's output is the fp32 P V, which no template writes): the template's softmax scale is 1/sqrt(128) to fp32
    precision, not the fp16 constant's square (0.04% off)."""
    fused = lower(to_compute_dtype(_attention(128), "fp16", io_dtype="fp16"),
                  patterns=fusion_patterns(["tvmfuse.attention"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.attention"], fused.rejections
    log = []
    (site,) = template_sites(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert site[3]["scale"] == pytest.approx(128 ** -0.5, rel=1e-6), log
    assert abs(float(np.float16(128 ** -0.25)) ** 2 / 128 ** -0.5 - 1) > 3e-4  # what it was


def _rope_cuda_source(dtype: str, monkeypatch):
    """(the CUDA source of the fused rotary group at head dim 128 in `dtype`, the cuda target)."""
    from checks import cuda_sources  # pylint: disable=import-outside-toplevel

    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(sys.modules[__name__], "D", 128)
    fused = lower(_rope_module(dtype), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    target = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(fused.mod, target), target))
    return src, target


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_rotary_group_compiles_for_cuda_with_16_byte_vectors(monkeypatch):
    """fp32 arithmetic in 8-lane vectors (head dim 128) compiles with nvcc (an fp32x8 broadcast of -1 did not:
    the negation stays fp16, exact there), and x, cos and sin still move in 16-byte vectors."""
    src, _ = _rope_cuda_source("float16", monkeypatch)
    assert src.count("*(uint4*)(x_ptr") == 3 and "*(uint4*)(cos_ptr" in src and "*(uint4*)(sin_ptr" in src
    assert "(float)(((half2*)" in src and "= (half)(((float2*)" in src  # up to fp32, one rounding down


@pytest.mark.gpu
@pytest.mark.parametrize("permute", [(), (0, 2, 1, 3)])
def test_gpu_rotary_group_rounds_once(permute, monkeypatch):
    """On the GPU (head dim 128, 8-lane vectors, Llama's K and Q forms): the fp32 rope of the fp16 inputs rounded
    once, to 1 ulp (an FMA may contract the fp32 sum)."""
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(sys.modules[__name__], "D", 128)
    fused = lower(_rope_module("float16", permute=permute), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    cuda, dev = resolve_target("cuda"), tvm.cuda(0)
    x, cos, sin = _inputs()
    sin_in = np.transpose(sin, (0, 2, 1, 3)) if permute else sin
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(fused.mod, cuda), cuda), dev)
    got = vm["main"](*[tvm.runtime.tensor(a, dev) for a in (x, cos, sin_in)]).numpy()
    t = (lambda a: np.transpose(a, permute)) if permute else (lambda a: a)
    once = _rope(t(x).astype("f4"), t(cos).astype("f4"), t(sin).astype("f4")).astype("float16")
    ulp = np.abs(got.astype("f8") - once.astype("f8")) / np.spacing(np.abs(once)).astype("f8")
    assert got.shape == once.shape and ulp.max() <= 1 and (got == once).mean() > 0.99


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_matmul_epilogue_runs_on_the_fp32_sums_and_rounds_once(act, llvm):
    """fp16 Linear+SiLU (Llama's gate) and +tanh-GELU (GPT-2's): the group's activation reads the fp32 matmul
    sums, not sums rounded to fp16 first, and rounds once at the store; the fp16 chain the precision stage wrote
    (round the sums, then the activation op by op in fp16) is further from the fp32 value."""
    import onnx
    from test_patterns import matmul_act

    from tvmfuse.frontend.importer import import_model
    from tvmfuse.prepare import prepare_module

    model = matmul_act(act, rows=64, k=256, n=128)
    fused = lower(prepare_module(import_model(model), "fp16", "fp16"), patterns=fusion_patterns())
    assert list(fused.kernel_patterns.values()) == [f"tvmfuse.matmul_{act}"], fused.rejections
    (kernel,) = fused.kernels()
    casts = [ln for ln in fused.mod[kernel].script().splitlines() if 'T.Cast("float16"' in ln]
    assert len(casts) == 1, casts  # the store's cast alone
    w = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W")).astype("float16")
    x = (np.random.default_rng(0).standard_normal((64, 256))).astype("float16")
    got = relax.VirtualMachine(tvm.compile(fused.mod, target="llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy().reshape(64, 128).astype("f8")
    g = x.astype("f8") @ w.astype("f8")

    def f(v):
        return v / (1 + np.exp(-v)) if act == "silu" else 0.5 * v * (1 + np.tanh(0.7978845608 * (v + 0.044715 * v ** 3)))
    exact = f(g)
    once = exact.astype("float16").astype("f8")
    ulp = np.spacing(np.abs(once).astype("float16")).astype("f8")
    # fp32 sums and fp32 math: within 1 ulp of rounding once, plus the fp32 summation's error bound (K * 2^-24 *
    # sum |x w|: it shows where the sum nearly cancels, at tiny outputs) and, for tanh-GELU, the absolute error of
    # TVM's fp32 tanh, ~1e-6 (where 1 + tanh(z) nearly cancels)
    sums = 1.1 * 256 * 2.0 ** -24 * (np.abs(x.astype("f8")) @ np.abs(w.astype("f8")))
    bad = np.abs(got - once) > ulp + sums + (2e-6 if act == "gelu_tanh" else 0)
    assert not bad.any(), (got[bad][:5], once[bad][:5], g[bad][:5])
    g16 = g.astype("float16")  # the chain before: the sums rounded, then fp16 op by op
    if act == "silu":
        chain = (g16 * (1 / (1 + np.exp(-g16.astype("f4")))).astype("float16")).astype("float16")
    else:
        h = (0.044715 * g16.astype("f4") ** 3 + g16).astype("float16")
        chain = (0.5 * g16 * (1 + np.tanh((0.7978845608 * h).astype("float16")).astype("float16"))).astype("float16")
    assert np.abs(chain.astype("f8") - exact).mean() > 1.2 * np.abs(got - exact).mean()


BF16 = ml_dtypes.bfloat16


def _bf16_ulp(a) -> np.ndarray:
    """The spacing of bf16 values at |a| (8 significant bits; np.spacing does not know bf16)."""
    mag = np.abs(np.asarray(a).astype("f8"))
    return np.exp2(np.floor(np.log2(np.where(mag > 0, mag, 2.0 ** -126))) - 7)


def test_bf16_rotary_group_computes_in_fp32_and_rounds_once(llvm):
    """bf16 has 3 fewer significant bits than fp16, so rounding the rope's two products and its sum to bf16 one
    by one costs more still: the bf16 group computes in fp32 too (casts up inside the kernel, one cast down at
    the store) and gives the fp32 rope of its bf16 inputs rounded once."""
    fused = lower(_rope_module("bfloat16"), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    (kernel,) = fused.kernels()
    script = fused.mod[kernel].script()
    assert 'T.Cast("float32"' in script and script.count('T.Cast("bfloat16"') == 1, script
    x, cos, sin = (a.astype("f4").astype(BF16) for a in _inputs())
    got = relax.VirtualMachine(tvm.compile(fused.mod, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in (x, cos, sin)]).numpy()
    assert got.dtype == BF16
    once = _rope(x.astype("f4"), cos.astype("f4"), sin.astype("f4")).astype(BF16)
    by_op = _rope(x, cos, sin)  # ml_dtypes bf16 arithmetic rounds every product and the sum
    ulp = np.abs(got.astype("f8") - once.astype("f8")) / _bf16_ulp(once)
    assert ulp.max() <= 1 and (got == once).mean() > 0.99  # 1 ulp: the fp32 sum may be contracted to an FMA
    assert (by_op != once).mean() > 0.05


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_bf16_rotary_group_compiles_for_cuda_with_16_byte_vectors(monkeypatch):
    """bf16 x, cos and sin move in 16-byte vectors (8 bf16), go up to fp32 pair by pair and come down once at
    the store; nvcc compiles it for sm_90a."""
    src, target = _rope_cuda_source("bfloat16", monkeypatch)
    assert src.count("*(uint4*)(x_ptr") == 3 and "*(uint4*)(cos_ptr" in src and "*(uint4*)(sin_ptr" in src
    assert "(float)(((nv_bfloat162*)" in src and "= (nv_bfloat16)(((float2*)" in src  # up to fp32, one rounding down
    with target:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000


@pytest.mark.gpu
@pytest.mark.parametrize("permute", [(), (0, 2, 1, 3)])
def test_gpu_bf16_rotary_group_rounds_once(permute, monkeypatch):
    """On the GPU, bf16 (head dim 128, Llama's K and Q forms): the fp32 rope of the bf16 inputs rounded once, to
    1 ulp."""
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(sys.modules[__name__], "D", 128)
    fused = lower(_rope_module("bfloat16", permute=permute), patterns=fusion_patterns(["tvmfuse.rotary_embedding"]))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    cuda, dev = resolve_target("cuda"), tvm.cuda(0)
    x, cos, sin = (a.astype("f4").astype(BF16) for a in _inputs())
    sin_in = np.transpose(sin, (0, 2, 1, 3)) if permute else sin
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(fused.mod, cuda), cuda), dev)
    got = vm["main"](*[tvm.runtime.tensor(a, dev) for a in (x, cos, sin_in)]).numpy()
    t = (lambda a: np.transpose(a, permute)) if permute else (lambda a: a)
    once = _rope(t(x).astype("f4"), t(cos).astype("f4"), t(sin).astype("f4")).astype(BF16)
    ulp = np.abs(got.astype("f8") - once.astype("f8")) / _bf16_ulp(once)
    assert got.dtype == BF16 and got.shape == once.shape and ulp.max() <= 1 and (got == once).mean() > 0.99
