"""Hand-written kernel templates: CPU variants vs numpy, CUDA variants compile with nvcc, registry and substitute."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from tvmfuse.kernels import ATTENTION_DECODE, ATTENTION_PREFILL, lookup, substitute

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})


def ref(q, k, v, mask=None, causal=False):
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, 1).astype("f4"), np.repeat(v, g, 1).astype("f4")
    s = q.astype("f4") @ kk.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask.astype("f4")
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vv


def run_cpu(fn, args, out_shape, dtype):
    ex = tvm.compile(tvm.IRModule({"main": fn}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    ex["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy().astype("f4")


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("float32", 1e-4)])
@pytest.mark.parametrize("split", [1, 4])
def test_decode_cpu_matches_numpy(dtype, tol, split):
    """Split-KV online softmax + combine, GQA (8 query heads over 2 KV heads)."""
    s = dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=256, head_dim=64, dtype=dtype)
    rng = np.random.default_rng(split)
    q, k, v = rand(rng, (2, 8, 1, 64), dtype), rand(rng, (2, 2, 256, 64), dtype), rand(rng, (2, 2, 256, 64), dtype)
    got = run_cpu(ATTENTION_DECODE(s, {"split": split}, "llvm"), [q, k, v], q.shape, dtype)
    assert np.abs(got - ref(q, k, v)).max() < tol


@pytest.mark.parametrize("variant", ["causal", "additive", "none"])
def test_prefill_cpu_matches_numpy(variant):
    """Tile-wise online softmax over block_n=32 tiles; causal tile skipping; additive broadcast mask; GQA."""
    s = dict(batch=1, heads=4, kv_heads=2, seq_q=64, seq_k=64, head_dim=64, dtype="float16",
             causal=variant == "causal", mask="additive" if variant == "additive" else "none", mask_shape=(1, 1, 64, 64))
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (1, 4, 64, 64), "float16"), rand(rng, (1, 2, 64, 64), "float16"), rand(rng, (1, 2, 64, 64), "float16")
    mask = (rng.standard_normal((1, 1, 64, 64)) * 3).astype("float16")
    args = [q, k, v] + ([mask] if variant == "additive" else [])
    got = run_cpu(ATTENTION_PREFILL(s, {"warps": 4, "block_n": 32}, "llvm"), args, q.shape, "float16")
    want = ref(q, k, v, mask if variant == "additive" else None, variant == "causal")
    assert np.abs(got - want).max() < 2e-3


def _cuda_compiles(fn):
    ex = tvm.compile(tvm.IRModule({"main": fn}), target=CUDA)
    src = ex.mod.imports[0].inspect_source("cuda")
    with CUDA:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000
    return src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_variants_compile():
    """The GPU variants at the issue's shapes (bf16 and fp16, causal/mask, hd 64/128) compile with nvcc."""
    dec = dict(batch=16, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")
    src = _cuda_compiles(ATTENTION_DECODE(dec, {"split": 16, "warps": 4, "unroll": 2}))
    assert "__shfl_xor_sync" in src
    pre = dict(batch=1, heads=32, kv_heads=8, seq_q=256, seq_k=256, head_dim=128, dtype="bfloat16", causal=True)
    src = _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 4, "block_n": 64}))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and "ldmatrix" in src
    pre.update(dtype="float16", causal=False, mask="additive", mask_shape=(1, 1, 256, 256), head_dim=64)
    _cuda_compiles(ATTENTION_PREFILL(pre, {"warps": 8, "block_n": 128}))


def test_registry_lookup_and_knobs():
    dec = dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=4096, head_dim=128, dtype="float16")
    pre = dict(dec, seq_q=2048, seq_k=2048, causal=True)
    assert lookup("tvmfuse.attention", dec) is ATTENTION_DECODE
    assert lookup("tvmfuse.attention", pre) is ATTENTION_PREFILL
    assert lookup("tvmfuse.attention", dict(pre, head_dim=80)) is None
    assert lookup("tvmfuse.attention", dict(pre, dtype="float32")) is None
    assert lookup("tvmfuse.swiglu", dec) is None
    assert ATTENTION_DECODE.check(dict(dec, kv_heads=5)) is not None
    space = ATTENTION_DECODE.knob_space(dec)
    assert {"split": 32, "warps": 4, "unroll": 2} in space and ATTENTION_DECODE.default_knobs(dec) in space
    assert ATTENTION_PREFILL.default_knobs(pre) in ATTENTION_PREFILL.knob_space(pre)


def _attention_module(mask: bool, kv_heads: int = 4):
    """softmax(Q K^T * 1/sqrt(d) [+ mask]) V in [B,H,S,D] fp16, lowered by the fuse stage."""
    from tvmfuse.fuse import lower
    from tvmfuse.patterns import fusion_patterns
    bb, dt = relax.BlockBuilder(), "float16"
    q, k, v = (relax.Var(n, relax.TensorType((1, 4, 64, 64), dt)) for n in "qkv")
    params = [q, k, v] + ([relax.Var("m", relax.TensorType((1, 1, 64, 64), dt))] if mask else [])
    with bb.function("main", params):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
            s = bb.emit(relax.op.multiply(s, relax.const(0.125, dt)))
            if mask:
                s = bb.emit(relax.op.add(s, params[3]))
            o = bb.emit_output(relax.op.matmul(bb.emit(relax.op.nn.softmax(s, axis=-1)), v))
        bb.emit_func_output(o)
    return lower(bb.get(), patterns=fusion_patterns(["tvmfuse.attention"]))


@pytest.mark.parametrize("mask", [True, False])
def test_substitute_replaces_attention_kernel(mask):
    fused = _attention_module(mask)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.attention"]
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert [o for _, o in log] == ["template attention_prefill"], log
    rng = np.random.default_rng(3)
    args = [rand(rng, (1, 4, 64, 64), "float16") for _ in range(3)] + ([rand(rng, (1, 1, 64, 64), "float16")] if mask else [])
    got = relax.VirtualMachine(tvm.compile(new, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(a) for a in args]).numpy().astype("f4")
    assert np.abs(got - ref(*args[:3], args[3] if mask else None)).max() < 2e-3


def test_substitute_leaves_unknown_kernels():
    fused = _attention_module(False)
    log = []
    assert substitute(fused.mod, {}, log=log) is fused.mod and log == []
    name = next(iter(fused.kernel_patterns))
    same = substitute(fused.mod, fused.kernel_patterns, info={name: {"scale": 0.5}}, log=log)
    assert same is fused.mod and "scale" in log[0][1]


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_matches_numpy():
    """On a GPU: both CUDA variants against numpy on small shapes."""
    dev, rng = tvm.cuda(0), np.random.default_rng(0)
    for tmpl, s, knobs, args in [
        (ATTENTION_DECODE, dict(batch=2, heads=8, kv_heads=2, seq_q=1, seq_k=512, head_dim=128, dtype="float16"),
         {"split": 4, "warps": 4, "unroll": 2}, [(2, 8, 1, 128), (2, 2, 512, 128), (2, 2, 512, 128)]),
        (ATTENTION_PREFILL, dict(batch=1, heads=4, kv_heads=2, seq_q=128, seq_k=128, head_dim=64, dtype="float16", causal=True),
         {"warps": 4, "block_n": 32}, [(1, 4, 128, 64), (1, 2, 128, 64), (1, 2, 128, 64)])]:
        arrs = [rand(rng, a, "float16") for a in args]
        lib = tvm.compile(tvm.IRModule({"main": tmpl(s, knobs)}), target=CUDA)
        out = tvm.runtime.tensor(np.zeros(args[0], "float16"), dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in arrs], out)
        assert np.abs(out.numpy().astype("f4") - ref(*arrs, causal=s.get("causal", False))).max() < 5e-3
